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


def _tensors(folder: Path):
    """``(file/tensor, tensor)`` for every tensor in the ``.safetensors`` files under ``folder`` (or of one file)."""
    from safetensors import safe_open

    files = [folder] if folder.is_file() else sorted(folder.rglob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in sorted(f.keys()):
                rel = file.name if folder.is_file() else file.relative_to(folder).as_posix()
                yield f"{rel}/{key}", f.get_tensor(key).contiguous()


def tensor_difference(rebuilt: Path, reference: Path) -> float:
    """The largest difference between the two builds' tensors, relative to each reference tensor's largest magnitude
    (``inf`` when their names or shapes differ): how far a rebuild that is not bit for bit is from the shipped file.
    On another CPU or torch build the kernels round differently and training amplifies it: the ShapesBench judges
    rebuilt on another VM differ by 0.009 (``alignment``) and 1.1 (``preference``, ``judge``: as far apart as two
    seeds), so a large value alone does not tell drift from a changed training."""
    got, ref = dict(_tensors(rebuilt)), dict(_tensors(reference))
    if got.keys() != ref.keys() or any(got[k].shape != ref[k].shape for k in ref):
        return float("inf")
    worst = 0.0
    for key, r in ref.items():
        r = r.double()
        scale = r.abs().max().item() or 1.0
        worst = max(worst, (got[key].double() - r).abs().max().item() / scale)
    return worst


def tensor_hashes(folder: Path) -> dict[str, str]:
    """``{file/tensor: sha256}`` of every tensor in the ``.safetensors`` files under ``folder`` (or of one file)."""
    return {name: hashlib.sha256(t.view(-1).view(torch.uint8).numpy()).hexdigest() for name, t in _tensors(folder)}
