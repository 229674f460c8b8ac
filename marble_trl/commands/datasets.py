"""``marble-trl datasets list`` / ``marble-trl datasets download [NAME ...] [--from FILE] [--force]``: the named prompt
sets (:mod:`marble_trl.data.prompt_sets`), their provenance and cache status (:mod:`marble_trl.data.prompt_files`), and
fetching them ahead of a run (e.g. before going offline, or on a login node)."""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marble-trl datasets",
        description="The papers' prompt sets by name (dataset_name: pickscore, ocr, geneval, drawbench, ..._test, "
        "marble_5rewards): shipped in the package or downloaded from a pinned commit, verified against the recorded "
        "digests, cached.",
    )
    sub = p.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="Every prompt set and mixture: provenance, licence, digests, cache status.")
    listing.add_argument("--json", action="store_true", help="One JSON object per set and mixture, for scripts.")
    get = sub.add_parser(
        "download",
        help="Download prompt sets into the cache and verify them (default: every set).",
        description="Download prompt sets (or the sets of a mixture) into the cache, verified; prints each file's "
        "path and SHA-256. With --from, check a file obtained by hand and copy it into the cache (offline machines).",
    )
    get.add_argument("names", nargs="*", metavar="NAME", help="Prompt sets or mixtures (default: every prompt set).")
    get.add_argument(
        "--from", dest="source", metavar="FILE", help="A copy of the set's file (one NAME): checked, then cached."
    )
    get.add_argument(
        "--force",
        action="store_true",
        help="Download again even when a verified copy is cached or shipped (a shipped set is otherwise unpacked).",
    )
    return p


def datasets_command(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    return _list(a.json) if a.action == "list" else _download(a.names, a.source, a.force)


def _size(n: int | None) -> str:
    return "size not recorded" if n is None else f"{n:,} bytes"


def _list(as_json: bool) -> int:
    from ..data import prompt_files as pc
    from ..data import prompt_sets as ps

    entries = [pc.describe(e) for e in ps.PROMPT_SETS.values()]
    mixtures = {name: [dict(s) for s in specs] for name, specs in ps.MIXTURES.items()}
    if as_json:
        for entry in entries:
            print(json.dumps(entry))
        for name, sources in mixtures.items():
            print(json.dumps({"mixture": name, "sources": sources}))
        return 0
    print(f"[marble-trl] prompt sets (cache: {pc.cache_root() / 'datasets'}; downloads off: {pc.offline() or 'no'})")
    width = max(map(len, [*ps.PROMPT_SETS, *ps.MIXTURES])) + 2
    for e in entries:
        rows = "rows not recorded" if e["rows"] is None else f"{e['rows']:,} prompts"
        cached = f"cached: {e['cache_path']}" if e["cached"] else "not cached"
        cached += ", shipped in the package" if e["shipped"] else ""
        print(f"{e['name']:<{width}}{rows}, {_size(e['size'])}, {e['licence']}, {cached}")
        print(f"    {e['description']}")
        print(f"    {e['url']}")
        sha = e["sha256"] or "not recorded (checked by its git blob id)"
        print(f"    sha256 {sha}; git blob {e['git_blob']}; columns {', '.join(e['columns'])}")
        if e["notes"]:
            print(f"    {e['notes']}")
    for name, sources in mixtures.items():
        parts = [f"{s['path']} (ratio {s['ratio']:g})" if s.get("ratio") else s["path"] for s in sources]
        how = "equal shares per step" if all(s.get("ratio") for s in sources) else "every row, concatenated"
        print(f"{name:<{width}}mixture of {', '.join(parts)}: {how}, with a 'source' column")
    return 0


def _download(names: list[str], source: str | None, force: bool) -> int:
    from ..data import prompt_files as pc
    from ..data import prompt_sets as ps

    wanted: list[str] = []
    for name in names or list(ps.PROMPT_SETS):
        members = [s["path"] for s in ps.MIXTURES[name]] if name in ps.MIXTURES else [name]
        wanted += [m for m in members if m not in wanted]
    unknown = [n for n in wanted if n not in ps.PROMPT_SETS]
    if unknown:
        raise SystemExit(
            f"marble-trl datasets download: unknown name(s) {unknown}; prompt sets: {', '.join(ps.PROMPT_SETS)}; "
            f"mixtures: {', '.join(ps.MIXTURES)}."
        )
    if source is not None and len(wanted) != 1:
        raise SystemExit("marble-trl datasets download --from FILE takes exactly one prompt set NAME.")
    failed = 0
    for name in wanted:
        entry = ps.PROMPT_SETS[name]
        try:
            if source is not None:
                path = pc.install(name, source)
            elif force:
                if pc.offline():
                    raise pc.PromptSetError(f"Prompt set {name!r}: --force needs downloads ({pc.offline()} is set).")
                path = pc.download(name)
            else:
                path = pc.local_file(name)
            sha256 = pc.verify(entry, path)
        except pc.PromptSetError as err:
            failed += 1
            print(f"[marble-trl] {name}: FAILED: {err}", file=sys.stderr)
            continue
        print(f"[marble-trl] {name}: {path} (sha256 {sha256}, {path.stat().st_size:,} bytes)")
    return 1 if failed else 0
