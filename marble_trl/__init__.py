"""marble_trl: multi-reward RL for text-to-image diffusion (MARBLE on DiffusionNFT) as a TRL extension.

The public names load on first use (PEP 562): ``import marble_trl`` and a command that needs no model (the CLI's
``--help``, its ``accelerate launch`` wrapper) do not import torch, diffusers and TRL.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__

_LAZY = {
    "MarbleDiffusionNFTConfig": ".nft_config",
    "MarbleDiffusionNFTTrainer": ".trainer",
    "build_tiny_sd3_pipeline": ".models",
    "load_sd3_pipeline": ".models",
    "save_tiny_sd3_pipeline": ".models",
}

__all__ = [
    "__version__",
    "MarbleDiffusionNFTConfig",
    "MarbleDiffusionNFTTrainer",
    "build_tiny_sd3_pipeline",
    "load_sd3_pipeline",
    "save_tiny_sd3_pipeline",
]

if TYPE_CHECKING:
    from .models import build_tiny_sd3_pipeline, load_sd3_pipeline, save_tiny_sd3_pipeline
    from .nft_config import MarbleDiffusionNFTConfig
    from .trainer import MarbleDiffusionNFTTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # once
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # `marble_trl.rewards.register_reward(...)`
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
