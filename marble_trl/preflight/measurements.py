"""Our measured activation bytes per sample, shipped with the package (``measured_memory.json``) and read here.

They come from ``benchmarks/memory_estimate.py`` (SD3.5 Medium) and ``benchmarks/family_memory.py`` (FLUX.1-dev,
Qwen-Image, Wan2.1-T2V-14B, Z-Image): ``saved_tensors_hooks`` count the bytes autograd keeps for the backward of the
trainable forward (LoRA r=32 on the family's default targets, bf16 autocast) of real-width transformers, block by
block. Each entry records the tokens it was measured at; :func:`activation_bytes` scales linearly to another token
count (every tensor saved is linear in the sequence length with fused attention kernels), which is an approximation
away from the measured point. ``python benchmarks/family_memory.py --ship`` / ``memory_estimate.py --ship`` rewrite
the entries from a new run.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

FILE = "measured_memory.json"


def path() -> Path:
    return Path(str(resources.files("marble_trl.preflight") / FILE))


@lru_cache(maxsize=1)
def load() -> dict:
    return json.loads(path().read_text(encoding="utf-8"))


def entry(name: str | None) -> dict | None:
    """The measured entry of an architecture (``None`` when it was not measured)."""
    if name is None:
        return None
    return load()["architectures"].get(name)


def activation_bytes(name: str | None, tokens: int) -> tuple[float | None, float | None]:
    """``(no checkpointing, checkpointing)`` bytes per sample at ``tokens`` sequence tokens, scaled linearly from the
    measured point; ``(None, None)`` when the architecture was not measured."""
    measured = entry(name)
    if measured is None:
        return None, None
    acts = measured["activation_bytes_per_sample"]
    scale = tokens / measured["tokens"]
    return acts["no_checkpointing"] * scale, acts["checkpointing"] * scale


def ship(name: str, activations: dict, tokens: int, conditions: str, source: str) -> None:
    """Write one architecture's measurement into the shipped file (the benchmarks' ``--ship``)."""
    data = json.loads(path().read_text(encoding="utf-8"))
    data["architectures"][name] = {
        "source": source,
        "conditions": conditions,
        "tokens": tokens,
        "activation_bytes_per_sample": activations,
    }
    path().write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    load.cache_clear()
