"""The reward-function contract (GRPO's conventions, for images) and scoring with validation.

A reward function is a callable ``fn(prompts, images, **columns) -> list[float | None]``:

- ``prompts``: ``list[str]`` of length ``B``;
- ``images``: float tensor ``[B, 3, H, W]`` in ``[0, 1]`` (see :mod:`marble_trl.rewards.images`);
- ``columns``: every other dataset column, one list of length ``B`` each (e.g. the text to render, GenEval metadata);
- returns a sequence (list, tuple, 1-D tensor or array) with one value per sample; ``None`` means "this reward does
  not apply to this sample" and gives a zero advantage for that reward (MARBLE Eq. 3). A NaN value is an error, not
  "not applicable": it is what NaN images or a broken reward model produce.

Internally :func:`score_rewards` stores "not applicable" as NaN in its float32 ``[K, B]`` output (the advantage code
masks NaN); only a ``None`` from the reward becomes that NaN.

The name used in logs is the callable's ``__name__`` (built-ins set it), as in TRL's GRPO.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence, Set
from numbers import Real
from typing import Any

import torch

RewardFunc = Callable[..., Sequence[float | None]]

FLOAT32_MAX = torch.finfo(torch.float32).max


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

    Raises :class:`RewardError` naming the reward (and the sample index and prompt, when one sample is at fault) if a
    reward raises, returns something other than a sequence of values (a dict, a set, a string, ...), the wrong number
    of values, a non-numeric value, NaN, an infinite value, or one beyond float32's range (about 3.4e38).
    """
    columns = columns or {}
    names = list(names) if names is not None else [reward_name(f) for f in reward_funcs]
    batch = len(prompts)
    out = torch.full((len(reward_funcs), batch), float("nan"), dtype=torch.float32)  # NaN: "not applicable"
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
        if isinstance(values, (Mapping, Set, str, bytes)):
            # list() of these "works" (a dict gives its keys, a string its characters) and would train on garbage.
            kind = "a mapping" if isinstance(values, Mapping) else f"a {type(values).__name__}"
            raise RewardError(
                f"Reward {name!r} returned {kind} ({type(values).__name__}); it must return a list with one float "
                "(or None for 'not applicable') per sample, in the order of the prompts. For a reward with several "
                "scores, register one reward per score (or return the one you train on)."
            )
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
            if value is None:  # not applicable: stays NaN in `out`
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            where = f"for sample {i} (prompt {prompts[i]!r})"
            if isinstance(value, bool) or not isinstance(value, Real):
                raise RewardError(
                    f"Reward {name!r} returned {value!r} ({type(value).__name__}) {where}; rewards must be real "
                    "numbers or None."
                )
            value = float(value)
            if math.isnan(value):
                raise RewardError(
                    f"Reward {name!r} returned NaN {where}. NaN is not 'not applicable': return None for a sample "
                    "the reward does not apply to. A NaN score usually comes from NaN images (a diverged model: "
                    "check the loss and grad_norm) or from the reward model itself."
                )
            if math.isinf(value) or abs(value) > FLOAT32_MAX:
                raise RewardError(
                    f"Reward {name!r} returned {value} {where}; rewards must be finite and within float32's range "
                    f"(|r| <= {FLOAT32_MAX:.4g}); rescale the reward (or return None for 'not applicable')."
                )
            out[k, i] = value
    return out
