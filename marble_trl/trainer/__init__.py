"""The trainer: :class:`MarbleDiffusionNFTTrainer` (``trainer.py``, the transformers/TRL hooks) over its stages:
``step.py`` (rewards -> advantages -> a typed step plan -> micro-batches) and ``backward.py`` (one micro-batch's
timestep loop, one strategy per back-end)."""

from .trainer import MarbleDiffusionNFTTrainer

__all__ = ["MarbleDiffusionNFTTrainer"]
