"""The old policy's and the reference's forwards, whichever the run trains: a LoRA (the ``old`` adapter; every
adapter disabled, :mod:`.lora`) or the transformer's own weights (the swapped-in copies of :mod:`.full`). The trainer's
rollouts, timestep loop and ``generate`` go through these two, never through one kind's."""

from __future__ import annotations

import contextlib

from torch import nn

from .full import attached_policy
from .lora import use_old_policy, use_reference


def use_old_weights(transformer: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The old policy's forward: the old-policy copy under full fine-tuning, else the ``old`` LoRA adapter."""
    policy = attached_policy(transformer)
    if policy is not None:
        return policy.use_old(transformer)
    return use_old_policy(transformer)


def use_reference_weights(transformer: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The reference's forward: the loaded weights under full fine-tuning, else the adapters disabled."""
    policy = attached_policy(transformer)
    if policy is not None:
        return policy.use_reference(transformer)
    return use_reference(transformer)
