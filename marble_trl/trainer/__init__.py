"""The trainer: :class:`MarbleDiffusionNFTTrainer` (``trainer.py``, the transformers/TRL hooks) over its stages:
``rollouts.py`` (a step's rollouts and rewards), ``step.py`` (rewards -> advantages -> a typed step plan ->
micro-batches), ``session.py`` (one optimizer step's state), ``backward.py`` (one micro-batch's timestep loop) and
``backends.py`` (plain / DDP, DeepSpeed, FSDP2); around them the hooks of saving, evaluation and balancing, the
non-finite guard (``guards.py``), what is printed (``console.py``) and the trackers (``trackers.py``)."""

from .trainer import MarbleDiffusionNFTTrainer

__all__ = ["MarbleDiffusionNFTTrainer"]
