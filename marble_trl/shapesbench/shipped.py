"""Weights shipped inside the package (``marble_trl/shapesbench/weights/``): the ShapesBench base model (the
``shapes`` model, ``load_sd3_pipeline("shapes")``) and the learned judges. Each is produced by the package's own
deterministic training (:mod:`.pretrain`, :mod:`.judges`) and named by the hash of its config, so a changed config
never picks up a stale file; ``MANIFEST.json`` records the config hashes and a SHA-256 of every tensor.

    python -m marble_trl.shapesbench ship            # (re)build and copy into the package folder
    python -m marble_trl.shapesbench verify-shipped  # rebuild from scratch in a temporary cache and compare
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..artifacts import SHIPPED_WEIGHTS

WEIGHTS = SHIPPED_WEIGHTS
MANIFEST = WEIGHTS / "MANIFEST.json"


def shipped_judge(key: str) -> Path | None:
    """The shipped judge file whose config hash is ``key``, if the package has it."""
    found = sorted(WEIGHTS.glob(f"*-{key}.safetensors"))
    return found[0] if found else None


def tensor_hashes(folder: Path) -> dict[str, str]:
    """``{file/tensor: sha256}`` of every tensor in the ``.safetensors`` files under ``folder`` (or of one file)."""
    import torch
    from safetensors import safe_open

    files = [folder] if folder.is_file() else sorted(folder.rglob("*.safetensors"))
    out = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in sorted(f.keys()):
                t = f.get_tensor(key).contiguous()
                rel = file.name if folder.is_file() else file.relative_to(folder).as_posix()
                out[f"{rel}/{key}"] = hashlib.sha256(t.view(-1).view(torch.uint8).numpy()).hexdigest()
    return out


def build_all(quiet: bool = True) -> dict[str, Path]:
    """Build (or find in the cache) the base model and every judge: ``{name: path}``."""
    from .judges import JUDGES, build_judge
    from .pretrain import PretrainConfig, pretrain

    built = {"shapes": pretrain(PretrainConfig(), quiet=quiet)}
    for name, config in JUDGES.items():
        built[name] = build_judge(config, quiet=quiet)
    return built


def manifest(built: dict[str, Path]) -> dict:
    from .judges import JUDGES
    from .pretrain import PretrainConfig

    entries = {"shapes": {"config_key": PretrainConfig().key(), "tensors": tensor_hashes(built["shapes"])}}
    for name, config in JUDGES.items():
        entries[name] = {"config_key": config.key(), "tensors": tensor_hashes(built[name])}
    return entries


def ship(quiet: bool = False) -> Path:
    """Copy the base model and the judges into the package folder and write ``MANIFEST.json``."""
    from .judges import JUDGES

    built = build_all(quiet=quiet)
    WEIGHTS.mkdir(parents=True, exist_ok=True)
    target = WEIGHTS / "shapes"
    if built["shapes"].resolve() != target.resolve():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(built["shapes"], target)
    for old in WEIGHTS.glob("*.safetensors"):
        if old.name not in {f"{n}-{c.key()}.safetensors" for n, c in JUDGES.items()}:
            old.unlink()
    for name, config in JUDGES.items():
        dst = WEIGHTS / f"{name}-{config.key()}.safetensors"
        if built[name].resolve() != dst.resolve():
            shutil.copyfile(built[name], dst)
    MANIFEST.write_text(json.dumps(manifest(built), indent=1, sort_keys=True) + "\n")
    return WEIGHTS


def verify_shipped(quiet: bool = False) -> list[str]:
    """Rebuild everything from scratch in a temporary cache and compare its tensors with ``MANIFEST.json``; returns
    the names whose tensors differ (empty: the shipped weights are reproduced bit for bit)."""
    from . import judges

    expected = json.loads(MANIFEST.read_text())
    old = os.environ.get("MARBLE_TRL_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MARBLE_TRL_CACHE"] = tmp
        try:
            from .pretrain import PretrainConfig, pretrain

            built = {"shapes": pretrain(PretrainConfig(), force=True, quiet=quiet)}
            for name, config in judges.JUDGES.items():
                built[name] = judges.build_judge(config, force=True, quiet=quiet)
            got = manifest(built)
        finally:
            if old is None:
                os.environ.pop("MARBLE_TRL_CACHE", None)
            else:
                os.environ["MARBLE_TRL_CACHE"] = old
    return [name for name in expected if expected[name] != got.get(name)]
