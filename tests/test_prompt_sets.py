"""The named prompt sets (marble_trl.data.prompt_sets; their files: marble_trl.data.prompt_files): the pinned
registry, download into the cache (from a local HTTP server, with the registry's URLs and digests pointed at synthetic files), verification, offline use, the mixture
``marble_5rewards`` (equal shares per step, source tags, GenEval columns) and ``marble-trl datasets``."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from collections import Counter
from pathlib import Path

import pytest
from prompt_set_stub import GENEVAL, TEXT, install_synthetic, patch_registry, synthetic_files

from marble_trl.cli import main
from marble_trl.data import prompt_files as pc
from marble_trl.data import prompt_sets as ps
from marble_trl.data.prompts import GroupSampler
from marble_trl.data.sources import (
    SHAPES_SOURCES,
    load_prompt_sources,
    load_source,
    mixture_ratios,
    named_mixture,
)
from marble_trl.rewards.ocr import quoted_text
from marble_trl.trainer.setup import source_indices

ROOT = Path(__file__).resolve().parents[1]


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        server = self.server
        server.requests.append(self.path)
        data = server.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.path in server.truncated:  # announce the whole file, send half, hang up
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A local HTTP server holding the synthetic sets; the registry's URLs and digests point at them; downloads on
    (the suite runs with HF_HUB_OFFLINE=1); an empty cache."""
    files = synthetic_files(tmp_path / "files")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.files = {f"/{name}/{file.name}": file.read_bytes() for name, file in files.items()}
    httpd.requests, httpd.truncated = [], set()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    patch_registry(monkeypatch, files, base_url=f"http://127.0.0.1:{httpd.server_address[1]}")
    for variable in pc.OFFLINE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("MARBLE_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pc.time, "sleep", lambda s: None)  # retries without waiting
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _cache_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# The registry --------------------------------------------------------------------------------------------------------


def test_registry_pins_every_set_to_a_commit_with_digests():
    assert set(ps.PROMPT_SETS) == {
        "pickscore", "pickscore_test", "ocr", "ocr_test", "geneval", "geneval_test", "drawbench"
    }  # fmt: skip
    for name, entry in ps.PROMPT_SETS.items():
        assert entry.name == name
        assert re.fullmatch(r"[0-9a-f]{40}", entry.commit) and re.fullmatch(r"[0-9a-f]{40}", entry.git_blob)
        assert entry.url == f"https://raw.githubusercontent.com/{entry.repo}/{entry.commit}/{entry.path}"
        assert entry.licence == {"yifan123/flow_grpo": "MIT", "NVlabs/DiffusionNFT": "Apache-2.0"}[entry.repo]
        assert entry.format in ("txt", "jsonl") and entry.columns[0] == "prompt"
        if entry.sha256 is None:  # not readable when recorded: checked by its git object id alone, and says so
            assert entry.size is None and entry.rows is None and entry.name in ("ocr", "geneval")
        else:
            assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256) and entry.size > 0 and entry.rows > 0
        assert name not in SHAPES_SOURCES and name != "bundled"
    assert ps.PROMPT_SETS["geneval"].columns == ("prompt", "tag", "include", "exclude")
    for name, specs in ps.MIXTURES.items():
        assert all(spec["path"] in ps.PROMPT_SETS for spec in specs), name
    assert [s["path"] for s in ps.MIXTURES["marble_5rewards"]] == ["pickscore", "ocr", "geneval"]


def test_git_blob_id_is_gits():
    assert pc.git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # `git hash-object /dev/null`
    assert pc.git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("MARBLE_TRL_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    entry = ps.PROMPT_SETS["pickscore"]
    assert pc.cached_path(entry) == tmp_path / "hf" / "marble_trl" / "datasets" / "pickscore" / entry.sha256[:16] / (
        "train.txt"
    )
    monkeypatch.setenv("MARBLE_TRL_CACHE", str(tmp_path / "mine"))
    assert (
        pc.cached_path(ps.PROMPT_SETS["ocr"]).parent == tmp_path / "mine" / "datasets" / "ocr" / "git-3ce0521b77b0a903"
    )


# The shipped sets ----------------------------------------------------------------------------------------------------


def test_every_set_whose_file_was_read_is_shipped_with_its_licence():
    shipped = {name for name, entry in ps.PROMPT_SETS.items() if pc.shipped_path(entry) is not None}
    assert shipped == {name for name, entry in ps.PROMPT_SETS.items() if entry.sha256 is not None}
    assert shipped == {"pickscore", "pickscore_test", "ocr_test", "geneval_test", "drawbench"}
    assert {p.name for p in pc.SHIPPED.glob("*.xz")} == {pc.shipped_path(ps.PROMPT_SETS[n]).name for n in shipped}
    assert (pc.SHIPPED / "LICENSE.flow_grpo").read_text().startswith("MIT License")
    assert "Apache License" in (pc.SHIPPED / "LICENSE.DiffusionNFT").read_text()
    # the wheel carries them: pyproject's package data names the folder's files
    package_data = (ROOT / "pyproject.toml").read_text()
    for pattern in ('"data/prompt_data/*.xz"', '"data/prompt_data/LICENSE.*"', '"data/prompt_data/README.md"'):
        assert pattern in package_data


@pytest.mark.parametrize("name", ["pickscore", "pickscore_test", "ocr_test", "geneval_test", "drawbench"])
def test_a_shipped_set_loads_offline_with_its_recorded_digests(name, monkeypatch, tmp_path):
    monkeypatch.setenv("MARBLE_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MARBLE_TRL_OFFLINE", "1")
    monkeypatch.setattr(pc, "_fetch", lambda *a: pytest.fail("a shipped set must not touch the network"))
    entry = ps.PROMPT_SETS[name]
    assert pc.available_offline(entry) and not pc.cached_path(entry).exists()
    path = pc.local_file(name)
    assert path == pc.cached_path(entry)
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry.sha256 and len(data) == entry.size
    assert pc.git_blob_id(data) == entry.git_blob
    rows = load_source(name)
    assert len(rows) == entry.rows and all(isinstance(r["prompt"], str) and r["prompt"] for r in rows)
    assert set(entry.columns) <= set(rows.column_names)


def test_a_damaged_shipped_copy_is_refused_and_nothing_is_cached(monkeypatch, tmp_path):
    import lzma

    entry = ps.PROMPT_SETS["drawbench"]
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    good = lzma.decompress(pc.shipped_path(entry).read_bytes())
    (shipped / pc.shipped_path(entry).name).write_bytes(lzma.compress(good.replace(b"giraffe", b"gorilla", 1)))
    monkeypatch.setattr(pc, "SHIPPED", shipped)
    monkeypatch.setenv("MARBLE_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MARBLE_TRL_OFFLINE", "1")
    with pytest.raises(pc.PromptSetError, match="expected SHA-256 " + entry.sha256):
        pc.local_file("drawbench")
    assert _cache_files(tmp_path / "cache") == []
    (shipped / pc.shipped_path(entry).name).write_bytes(b"not xz at all")  # a truncated or overwritten file
    with pytest.raises(pc.PromptSetError, match="is damaged"):
        pc.local_file("drawbench")
    assert _cache_files(tmp_path / "cache") == []


def test_a_damaged_shipped_copy_is_downloaded_instead_when_online(server, tmp_path, monkeypatch):
    entry = ps.PROMPT_SETS["drawbench"]  # the server's synthetic digests: its shipped name must exist for this test
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / f"drawbench-{entry.sha256[:16]}.txt.xz").write_bytes(b"damaged")
    monkeypatch.setattr(pc, "SHIPPED", shipped)
    path = pc.local_file("drawbench")
    assert pc.verify(entry, path) == entry.sha256 and server.requests == ["/drawbench/test.txt"]


# Download, verification, offline use ---------------------------------------------------------------------------------


def test_download_verifies_caches_and_is_reused(server, tmp_path):
    path = pc.local_file("pickscore")
    entry = ps.PROMPT_SETS["pickscore"]
    assert path == tmp_path / "cache" / "datasets" / "pickscore" / entry.sha256[:16] / "train.txt"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
    assert _cache_files(tmp_path / "cache") == [path]  # no temporary file left
    dataset = load_source("pickscore")
    assert dataset["prompt"] == TEXT["pickscore"]
    assert server.requests == ["/pickscore/train.txt"]  # the second use read the cache


def test_cached_copy_is_used_offline_without_network(server, monkeypatch):
    pc.local_file("geneval")
    server.shutdown()
    server.server_close()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dataset = load_source("geneval")
    assert dataset["prompt"] == [row["prompt"] for row in GENEVAL["geneval"]]
    assert server.requests == ["/geneval/train_metadata.jsonl"]


def test_offline_without_a_cached_copy_says_how_to_place_it(server, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    entry = ps.PROMPT_SETS["ocr_test"]
    with pytest.raises(pc.PromptSetError) as err:
        load_source("ocr_test")
    message = str(err.value)
    for part in ("'ocr_test'", entry.url, entry.sha256, "HF_HUB_OFFLINE=1", "marble-trl datasets download ocr_test"):
        assert part in message, part
    assert "--from FILE" in message and str(pc.cached_path(entry).parent) in message
    assert server.requests == []


def test_a_set_without_a_recorded_sha256_is_checked_by_its_git_blob(server, monkeypatch, tmp_path):
    entry = ps.PROMPT_SETS["ocr"]
    unrecorded = ps.PromptSet(**{**entry.__dict__, "sha256": None, "size": None, "rows": None})
    monkeypatch.setitem(ps.PROMPT_SETS, "ocr", unrecorded)
    path = pc.local_file("ocr")
    assert path.parent.name == f"git-{entry.git_blob[:16]}"
    server.files["/ocr/train.txt"] = b'a sign that says "NOT THE FILE"\n'
    path.unlink()
    with pytest.raises(pc.PromptSetError, match=f"expected git blob id {entry.git_blob}"):
        pc.local_file("ocr")
    assert not path.exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(pc.PromptSetError, match="SHA-256 not recorded; git blob id"):
        pc.local_file("ocr")


def test_a_file_with_another_hash_is_refused_and_not_kept(server, tmp_path):
    entry = ps.PROMPT_SETS["drawbench"]
    bad = b"x" * entry.size  # the right size, another content
    server.files["/drawbench/test.txt"] = bad
    with pytest.raises(pc.PromptSetError) as err:
        pc.local_file("drawbench")
    message = str(err.value)
    assert f"expected SHA-256 {entry.sha256}" in message
    assert f"got {hashlib.sha256(bad).hexdigest()}" in message
    assert _cache_files(tmp_path / "cache") == []


def test_a_partial_download_is_never_cached(server, tmp_path):
    server.truncated.add("/geneval_test/test_metadata.jsonl")
    with pytest.raises(pc.PromptSetError):
        pc.local_file("geneval_test")
    assert len(server.requests) == 3  # retried, then given up
    assert _cache_files(tmp_path / "cache") == []


def test_an_interrupted_download_leaves_no_file(server, tmp_path, monkeypatch):
    def half_then_interrupt(entry, out, timeout):
        out.write(b"a red apple")
        raise KeyboardInterrupt

    monkeypatch.setattr(pc, "_fetch", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        pc.local_file("pickscore")
    assert _cache_files(tmp_path / "cache") == []


def test_a_corrupt_cached_copy_is_replaced(server, tmp_path):
    path = pc.local_file("pickscore_test")
    path.write_text("edited by hand\n")
    assert pc.local_file("pickscore_test") == path
    assert path.read_bytes() == server.files["/pickscore_test/test.txt"]
    assert len(server.requests) == 2


def test_an_unreachable_server_names_the_url_and_the_manual_route(server):
    del server.files["/ocr_test/test.txt"]
    with pytest.raises(pc.PromptSetError, match="could not download .*404.*--from FILE"):
        pc.local_file("ocr_test")
    assert len(server.requests) == 1  # a 404 is not retried


def test_install_checks_a_file_placed_by_hand(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("not the prompts\n")
    with pytest.raises(pc.PromptSetError, match="expected size"):
        pc.install("pickscore", wrong)
    assert _cache_files(tmp_path / "cache") == []
    right = tmp_path / "train.txt"
    right.write_bytes(server.files["/pickscore/train.txt"])
    assert pc.install("pickscore", right) == pc.cached_path(ps.PROMPT_SETS["pickscore"])
    assert load_source("pickscore")["prompt"] == TEXT["pickscore"]
    assert server.requests == []


# The mixture and the columns -----------------------------------------------------------------------------------------


@pytest.fixture
def cached_sets(tmp_path, monkeypatch):
    """The synthetic sets installed in a cache, downloads off (as in the rest of the suite)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return install_synthetic(monkeypatch, tmp_path)


def test_marble_5rewards_draws_equal_shares_per_step_with_source_tags(cached_sets):
    sources = named_mixture("marble_5rewards")
    dataset = load_prompt_sources(sources, add_source_column=True)
    ratios = mixture_ratios(sources)
    assert ratios == {"pickscore": 1 / 3, "ocr": 1 / 3, "geneval": 1 / 3}
    expected = {
        "pickscore": TEXT["pickscore"],
        "ocr": TEXT["ocr"],
        "geneval": [r["prompt"] for r in GENEVAL["geneval"]],
    }
    for name, prompts in expected.items():
        assert [r["prompt"] for r in dataset if r["source"] == name] == prompts
    rows, shares = source_indices(dataset, ratios)
    source_of = dataset["source"]
    for prompts_per_step in (6, 48):  # the release's sampling round (2 / 2 / 2) and its step (16 / 16 / 16)
        sampler = GroupSampler(len(dataset), 1, prompts_per_step, seed=42, sources=rows, ratios=shares)
        order = list(sampler)
        for start in range(0, len(order), prompts_per_step):
            counts = Counter(source_of[i] for i in order[start : start + prompts_per_step])
            assert counts == {name: prompts_per_step // 3 for name in expected}, counts


def test_geneval_rows_carry_their_metadata_and_other_rows_none(cached_sets):
    dataset = load_prompt_sources(named_mixture("marble_5rewards"), add_source_column=True)
    assert dataset.column_names == ["prompt", "tag", "include", "exclude", "source"]
    geneval = [r for r in dataset if r["source"] == "geneval"]
    for row, raw in zip(geneval, GENEVAL["geneval"]):
        assert (row["tag"], row["include"], row["exclude"]) == (raw["tag"], raw["include"], raw.get("exclude"))
    assert geneval[2]["include"][1]["position"] == ["right of", 0]  # a mixed-type list survives
    for row in dataset:
        if row["source"] != "geneval":
            assert row["tag"] is row["include"] is row["exclude"] is None
    # Applicability, as the rewards decide it: GenEval by its metadata, OCR by quoted text in the prompt (not by the
    # source: a PickScore prompt with quoted text gets an OCR score, as in the release).
    ocr_applies = {r["prompt"] for r in dataset if quoted_text(r["prompt"]) is not None}
    assert ocr_applies == {*TEXT["ocr"], 'a mug printed with "GOOD MORNING"'}
    assert {r["source"] for r in dataset if r["include"] is not None} == {"geneval"}
    # The in-process GenEval reward's reading of these columns (where that module is present).
    metadata = pytest.importorskip("marble_trl.rewards.geneval.metadata")
    if not hasattr(metadata, "row_metadata"):
        pytest.skip("marble_trl.rewards.geneval.metadata has no row_metadata")
    columns = {c: dataset[c] for c in ("tag", "include", "exclude", "source")}
    read = metadata.row_metadata(columns, len(dataset))
    assert [m is not None for m in read] == [s == "geneval" for s in dataset["source"]]
    assert [m["include"] for m in read if m is not None] == [r["include"] for r in GENEVAL["geneval"]]


def test_the_test_mixture_and_single_sets_load_as_eval_datasets(cached_sets):
    from marble_trl.commands.train import load_train_dataset

    test = load_train_dataset("marble_5rewards_test")
    assert Counter(test["source"]) == {"pickscore": 2, "ocr": 2, "geneval": 2}
    paper = load_train_dataset("paper_eval")  # the papers' tables: DrawBench and the OCR / GenEval test splits
    assert Counter(paper["source"]) == {"drawbench": len(TEXT["drawbench"]), "ocr": 2, "geneval": 2}
    assert load_train_dataset("drawbench")["prompt"] == TEXT["drawbench"]
    assert load_train_dataset("geneval_test").column_names == ["tag", "include", "prompt", "exclude"]


def test_a_named_mixture_inside_dataset_mixture_is_refused_clearly(cached_sets):
    with pytest.raises(ValueError, match="is a named mixture.*dataset_name: marble_5rewards"):
        load_prompt_sources(["marble_5rewards", "drawbench"])


def test_the_paper_recipes_resolve_the_named_mixture(cached_sets, tmp_path):
    """The 5-reward recipes through marble-trl train's own parser and dataset loading (no model)."""
    from marble_trl.commands.train import load_script_datasets, train_parser

    for recipe in ("sd35m-marble-5rewards.yaml", "sd35m-marble-5rewards-released.yaml"):
        script, training = train_parser().parse_args_and_config(
            args=["--config", str(ROOT / "recipes" / recipe), "--output_dir", str(tmp_path / "o"), "--bf16", "false"]
        )
        dataset, _ = load_script_datasets(script, training)
        assert training.source_ratios == {"pickscore": 1 / 3, "ocr": 1 / 3, "geneval": 1 / 3}, recipe
        assert Counter(dataset["source"]) == {"pickscore": 4, "ocr": 3, "geneval": 3}, recipe


# marble-trl datasets -------------------------------------------------------------------------------------------------


def test_datasets_list_shows_provenance_licence_hash_and_cache(cached_sets, capsys):
    assert main(["datasets", "list"]) == 0
    out = capsys.readouterr().out
    for name, entry in ps.PROMPT_SETS.items():
        assert re.search(rf"^{name} +.*{entry.licence}, cached: ", out, re.M), name
        assert entry.url in out and entry.sha256 in out and entry.git_blob in out
    assert "marble_5rewards " in out and "equal shares per step" in out
    assert main(["datasets", "list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sets = {r["name"]: r for r in rows if "name" in r}
    assert sets.keys() == ps.PROMPT_SETS.keys() and all(r["cached"] for r in sets.values())
    assert {r["mixture"] for r in rows if "mixture" in r} == set(ps.MIXTURES)


def test_datasets_download_fetches_a_mixtures_sets(server, tmp_path, capsys):
    assert main(["datasets", "download", "marble_5rewards"]) == 0
    out = capsys.readouterr().out
    assert sorted(server.requests) == ["/geneval/train_metadata.jsonl", "/ocr/train.txt", "/pickscore/train.txt"]
    for name in ("pickscore", "ocr", "geneval"):
        assert f"sha256 {ps.PROMPT_SETS[name].sha256}" in out and str(pc.cached_path(ps.PROMPT_SETS[name])) in out
    assert main(["datasets", "download", "pickscore"]) == 0  # cached: nothing fetched
    assert len(server.requests) == 3
    assert main(["datasets", "download", "pickscore", "--force"]) == 0
    assert len(server.requests) == 4
    assert main(["datasets", "list"]) == 0
    assert re.search(r"^pickscore +.*cached: ", capsys.readouterr().out, re.M)


def test_datasets_download_offline_and_from_a_file(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["datasets", "download", "drawbench"]) == 1
    err = capsys.readouterr().err
    assert "drawbench: FAILED" in err and ps.PROMPT_SETS["drawbench"].url in err
    copy = tmp_path / "test.txt"
    copy.write_bytes(server.files["/drawbench/test.txt"])
    assert main(["datasets", "download", "drawbench", "--from", str(copy)]) == 0
    assert pc.cached_path(ps.PROMPT_SETS["drawbench"]).read_bytes() == copy.read_bytes()
    assert server.requests == []
    with pytest.raises(SystemExit, match="unknown name"):
        main(["datasets", "download", "pickscor"])
    with pytest.raises(SystemExit, match="exactly one"):
        main(["datasets", "download", "marble_5rewards", "--from", str(copy)])


def test_evaluate_expands_the_test_mixture(cached_sets, monkeypatch):
    """`marble-trl evaluate --prompts marble_5rewards_test drawbench`: the mixture's sources and the set, labelled."""
    import marble_trl.evaluation.run as evaluation

    class Loaded(Exception):
        pass

    def capture(model, models, dataset, *args, **kwargs):
        raise Loaded(dataset)

    monkeypatch.setattr(evaluation, "evaluate_models", capture)
    argv = ["evaluate", "--prompts", "marble_5rewards_test", "drawbench", "--max_prompts", "1"]
    with pytest.raises(Loaded) as loaded:
        main([*argv, "--reward_funcs", "brightness", "--output", "unused"])
    dataset = loaded.value.args[0]
    assert dataset["source"] == ["pickscore", "ocr", "geneval", "drawbench"]
    assert dataset["prompt"][-1] == TEXT["drawbench"][0]
