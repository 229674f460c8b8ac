"""marble_trl: multi-reward RL for text-to-image diffusion (MARBLE on DiffusionNFT) as a TRL extension."""

from ._version import __version__
from .models import build_tiny_sd3_pipeline, load_sd3_pipeline, save_tiny_sd3_pipeline
from .nft_config import MarbleDiffusionNFTConfig
from .trainer import MarbleDiffusionNFTTrainer

__all__ = [
    "__version__",
    "MarbleDiffusionNFTConfig",
    "MarbleDiffusionNFTTrainer",
    "build_tiny_sd3_pipeline",
    "load_sd3_pipeline",
    "save_tiny_sd3_pipeline",
]
