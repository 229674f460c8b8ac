"""The reward-function contract (GRPO's conventions, for images) and scoring with validation.

A reward function is a callable ``fn(prompts, images, **columns) -> list[float | None]``:

- ``prompts``: ``list[str]`` of length ``B``;
- ``images``: float tensor ``[B, 3, H, W]`` in ``[0, 1]`` (see :mod:`marble_trl.rewards.images`);
- ``columns``: every other dataset column, one list of length ``B`` each (e.g. the text to render, GenEval metadata);
- returns one value per sample; ``None`` (or NaN) means "this reward does not apply to this sample" and gives a zero
  advantage for that reward (MARBLE Eq. 3).

The name used in logs is the callable's ``__name__`` (built-ins set it), as in TRL's GRPO.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

import torch

RewardFunc = Callable[..., Sequence[float | None]]


class RewardError(RuntimeError):
    """A reward function failed or returned values the trainer cannot use."""


def reward_name(fn: RewardFunc) -> str:
    """The name a reward is logged under: ``__name__`` of a function or instance, else its class name."""
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def score_rewards(
    reward_funcs: Sequence[RewardFunc],
    prompts: list[str],
    images: torch.Tensor,
    columns: dict[str, list[Any]] | None = None,
    names: Sequence[str] | None = None,
    timings: dict[str, float] | None = None,
) -> torch.Tensor:
    """Call every reward and return a ``[K, B]`` float32 tensor, NaN where a reward does not apply.

    If ``timings`` is given, it receives each reward's scoring time in seconds, keyed by name.

    Raises :class:`RewardError` naming the reward (and the prompt, when one sample is at fault) if a reward raises,
    returns the wrong number of values, a non-numeric value, or an infinite one.
    """
    columns = columns or {}
    names = list(names) if names is not None else [reward_name(f) for f in reward_funcs]
    batch = len(prompts)
    out = torch.full((len(reward_funcs), batch), float("nan"), dtype=torch.float32)
    for k, (fn, name) in enumerate(zip(reward_funcs, names)):
        start = time.perf_counter()
        try:
            values = fn(prompts=prompts, images=images, **columns)
        except Exception as err:  # re-raised with the reward's name: the user must know which one broke
            raise RewardError(
                f"Reward {name!r} raised {type(err).__name__}: {err} (batch of {batch} prompts, first: {prompts[0]!r})."
            ) from err
        if timings is not None:
            timings[name] = time.perf_counter() - start
        try:
            values = list(values)
        except TypeError as err:
            raise RewardError(
                f"Reward {name!r} returned {type(values).__name__}; it must return a list with one float (or None) "
                "per sample."
            ) from err
        if len(values) != batch:
            raise RewardError(
                f"Reward {name!r} returned {len(values)} values for {batch} samples; return exactly one float "
                "(or None for 'not applicable') per sample."
            )
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, Real):
                raise RewardError(
                    f"Reward {name!r} returned {value!r} ({type(value).__name__}) for prompt {prompts[i]!r}; "
                    "rewards must be real numbers or None."
                )
            value = float(value)
            if math.isinf(value):
                raise RewardError(
                    f"Reward {name!r} returned {value} for prompt {prompts[i]!r}; rewards must be finite "
                    "(return None or NaN for 'not applicable')."
                )
            out[k, i] = value
    return out
