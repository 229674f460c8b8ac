"""Building, shipping and verifying the weights in ``marble_trl/shapesbench/weights/`` (see :mod:`.shipped`).

python -m marble_trl.shapesbench ship            # (re)build and copy into the package folder
python -m marble_trl.shapesbench verify-shipped  # rebuild from scratch in a temporary cache and compare
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from . import judges, pretrain, shipped

# Module references (not names) so that tests can point the build at a temporary folder.


def configs() -> tuple[pretrain.PretrainConfig, dict[str, judges.JudgeConfig]]:
    """What is shipped: the default pretraining config and every judge's (tests point this at tiny ones)."""
    return pretrain.PretrainConfig(), dict(judges.JUDGES)


def _build_judges(configs: dict, force: bool, quiet: bool) -> dict[str, Path]:
    return {name: judges.build_judge(config, force=force, quiet=quiet) for name, config in configs.items()}


def build_all(quiet: bool = True, force: bool = False, jobs: int = 2) -> dict[str, Path]:
    """Build (or find in the cache) the base model and every judge: ``{name: path}``. With ``jobs=2`` the base
    model and the judges train at once in two processes (one thread each, so the results are the same bits): the
    pretraining's time is then about the longer of the two."""
    config, judge_configs = configs()  # made here: the workers get them pickled
    if jobs < 2:
        base = pretrain.pretrain(config, force=force, quiet=quiet)
        return {"shapes": base, **_build_judges(judge_configs, force, quiet)}
    # spawn, not fork: a forked child of a process that has run torch's thread pool can hang
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        base = pool.submit(pretrain.pretrain, config, force, quiet)
        built = pool.submit(_build_judges, judge_configs, force, quiet)
        return {"shapes": base.result(), **built.result()}


def manifest(built: dict[str, Path]) -> dict:
    config, judge_configs = configs()
    entries = {"shapes": {"config_key": config.key(), "tensors": shipped.tensor_hashes(built["shapes"])}}
    for name, config in judge_configs.items():
        entries[name] = {"config_key": config.key(), "tensors": shipped.tensor_hashes(built[name])}
    return entries


def shipped_path(name: str) -> Path:
    """Where ``name`` (``shapes`` or a judge) lies in the package folder."""
    if name == "shapes":
        return shipped.WEIGHTS / "shapes"
    return shipped.WEIGHTS / f"{name}-{configs()[1][name].key()}.safetensors"


def ship(quiet: bool = False, jobs: int = 2) -> Path:
    """Copy the base model and the judges into the package folder and write ``shipped.MANIFEST.json``."""
    built = build_all(quiet=quiet, jobs=jobs)
    shipped.WEIGHTS.mkdir(parents=True, exist_ok=True)
    target = shipped_path("shapes")
    if built["shapes"].resolve() != target.resolve():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(built["shapes"], target)
    judge_files = {name: shipped_path(name) for name in configs()[1]}
    for old in shipped.WEIGHTS.glob("*.safetensors"):
        if old not in judge_files.values():
            old.unlink()
    for name, dst in judge_files.items():
        if built[name].resolve() != dst.resolve():
            shutil.copyfile(built[name], dst)
    shipped.MANIFEST.write_text(json.dumps(manifest(built), indent=1, sort_keys=True) + "\n")
    return shipped.WEIGHTS


def verify_shipped(quiet: bool = False, jobs: int = 2) -> dict[str, float]:
    """Rebuild everything from scratch in a temporary cache and compare its tensors with ``shipped.MANIFEST.json``.
    Returns ``{name: difference}`` for every artifact whose tensors differ (empty: the shipped weights are reproduced
    bit for bit), the difference being :func:`.shipped.tensor_difference` from the shipped file (``nan`` where the
    package folder lacks it)."""
    expected = json.loads(shipped.MANIFEST.read_text())
    old = os.environ.get("MARBLE_TRL_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MARBLE_TRL_CACHE"] = tmp
        try:
            built = build_all(quiet=quiet, force=True, jobs=jobs)
            got = manifest(built)
            differ = {}
            for name in expected:
                if expected[name] == got.get(name):
                    continue
                reference = shipped_path(name) if name in built else None
                found = reference is not None and reference.exists()
                differ[name] = shipped.tensor_difference(built[name], reference) if found else float("nan")
        finally:
            if old is None:
                os.environ.pop("MARBLE_TRL_CACHE", None)
            else:
                os.environ["MARBLE_TRL_CACHE"] = old
    return differ
