"""The documentation cannot silently fall behind the code.

- every config field that is not a plain inherited ``TrainingArguments`` field (i.e. every field the config class
  declares itself: its new fields and the inherited ones whose default it changes), and every ``marble-trl train``
  script argument, appears in docs/config.md as `name`;
- every metric name the trainer logs appears in docs/metrics.md;
- every relative link between docs pages resolves (file and, when given, heading anchor);
- every Markdown table has the same number of cells in each row (an unescaped ``|`` would silently shift columns).

The fields are read from the source with ``ast`` rather than imported: importing the config pulls in torch,
transformers and TRL (seconds), and this file must stay fast.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lowercase, drop punctuation except '-' and '_', spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _dataclass_fields(module: Path, class_name: str) -> list[str]:
    """Names of the annotated fields declared in the body of ``class_name`` in ``module`` (in order)."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            ]
    raise AssertionError(f"class {class_name} not found in {module}")


def test_docs_pages_exist():
    names = {p.name for p in PAGES}
    for required in ("index.md", "getting-started.md", "config.md", "nft-loss.md", "marble.md", "metrics.md"):
        assert required in names, f"docs/{required} is missing"


def test_every_config_field_is_documented():
    text = (DOCS / "config.md").read_text(encoding="utf-8")
    fields = _dataclass_fields(ROOT / "marble_trl" / "nft_config.py", "MarbleDiffusionNFTConfig")
    assert {"lora_r", "learning_rate", "marble_rho", "param_ema"} <= set(fields) and "output_dir" not in fields
    missing = [name for name in fields if f"`{name}`" not in text]
    assert not missing, f"docs/config.md does not document these MarbleDiffusionNFTConfig fields: {missing}"


def test_every_script_argument_is_documented():
    text = (DOCS / "config.md").read_text(encoding="utf-8")
    fields = _dataclass_fields(ROOT / "marble_trl" / "commands" / "train.py", "MarbleScriptArguments")
    assert {"model_name_or_path", "reward_funcs"} <= set(fields)
    missing = [name for name in fields if f"`{name}`" not in text]
    assert not missing, f"docs/config.md does not document these MarbleScriptArguments fields: {missing}"


def test_every_logged_metric_is_documented():
    source = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "marble_trl" / "trainer").glob("*.py")))
    # Keys of self._metrics, directly, through a returned `metrics` dict (trainer/metrics.py) or the per-micro-batch
    # `sums` dict of the timestep loop.
    names = set(re.findall(r"(?:metrics|sums)\[f?\"([^\"]+)\"\]", source))
    assert {"rewards/{name}/mean", "kl", "nft/loss_pos", "marble/worst_cos", "time/balancer"} <= names
    # Evaluation keys ({prefix}_*, {metric_key_prefix}_*: documented as eval_*) and a user's log_extra columns (extra/{column}, documented in
    # coming-from-grpo.md) are not training metrics.
    names = {n for n in names if not re.match(r"\{[^}]*\}_", n) and not n.startswith("extra/")}
    # Placeholders in the code are written {name} in the docs ({source}, a prompt source, stays {source}).
    names = {re.sub(r"\{(?!source\})[^}]*\}", "{name}", n) for n in names}
    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"docs/metrics.md does not document these logged metrics: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path):
    broken = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{target} (no file {dest})")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"docs/{page.name} has broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_tables_are_well_formed(page: Path):
    bad = []
    width = None
    fenced = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if _FENCE.match(stripped):
            fenced = not fenced
        if fenced or not stripped.startswith("|"):
            width = None
            continue
        cells = len(_CELL_SPLIT.split(stripped)) - 2
        if width is None:
            width = cells
        elif cells != width:
            bad.append(f"line {number}: {cells} cells, the table has {width}")
    assert not bad, f"docs/{page.name}: malformed table rows (escape '|' inside cells as '\\|'): {bad}"
