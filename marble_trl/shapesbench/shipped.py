"""Weights shipped inside the package (``marble_trl/shapesbench/weights/``): the ShapesBench base model (the
``shapes`` model, ``load_sd3_pipeline("shapes")``) and the learned judges. Each is produced by the package's own
deterministic training (:mod:`.pretrain`, :mod:`.judges`) and named by the hash of its config, so a changed config
never picks up a stale file; ``MANIFEST.json`` records the config hashes and a SHA-256 of every tensor
(:mod:`.ship` builds and verifies them).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..artifacts import SHIPPED_WEIGHTS

WEIGHTS = SHIPPED_WEIGHTS
MANIFEST = WEIGHTS / "MANIFEST.json"


def shipped_judge(key: str) -> Path | None:
    """The shipped judge file whose config hash is ``key``, if the package has it."""
    found = sorted(WEIGHTS.glob(f"*-{key}.safetensors"))
    return found[0] if found else None


def base_model(config=None) -> Path:
    """The base model of ``config`` (default: :class:`~.pretrain.PretrainConfig`): the shipped ``shapes`` model when
    its recorded config hash matches, else :func:`~.pretrain.pretrain`'s (cached or built). So a fresh clone runs
    the benchmark on the shipped model without pretraining, and a changed pretraining config never gets it."""
    from .pretrain import PretrainConfig, pretrain

    config = config or PretrainConfig()
    info = WEIGHTS / "shapes" / "shapesbench.json"
    if info.is_file() and json.loads(info.read_text()).get("key") == config.key():
        return WEIGHTS / "shapes"
    return pretrain(config)


def tensor_hashes(folder: Path) -> dict[str, str]:
    """``{file/tensor: sha256}`` of every tensor in the ``.safetensors`` files under ``folder`` (or of one file)."""
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
