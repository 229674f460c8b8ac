"""The trainer's historical import path (``from marble_trl.nft_trainer import MarbleDiffusionNFTTrainer``), kept for
users' scripts; the code is in :mod:`marble_trl.trainer`."""

from .trainer import MarbleDiffusionNFTTrainer

__all__ = ["MarbleDiffusionNFTTrainer"]
