"""The reward-function contract (GRPO's conventions, for images): its checks, names and what rewards log.

A reward function is a callable ``fn(prompts, images, **columns) -> list[float | None]``:

- ``prompts``: ``list[str]`` of length ``B``;
- ``images``: float tensor ``[B, 3, H, W]`` in ``[0, 1]`` (see :mod:`marble_trl.rewards.images`);
- ``columns``: every other dataset column, one list of length ``B`` each (e.g. the text to render, GenEval metadata);
- returns a sequence (list, tuple, 1-D tensor or array) with one value per sample; ``None`` means "this reward does
  not apply to this sample" and gives a zero advantage for that reward (MARBLE Eq. 3). A NaN value is an error, not
  "not applicable": it is what NaN images or a broken reward model produce.

Internally :func:`~marble_trl.rewards.scoring.score_rewards` stores "not applicable" as NaN in its float32 ``[K, B]``
output (the advantage code masks NaN); only a ``None`` from the reward becomes that NaN.

The name used in logs is the callable's ``__name__`` (built-ins set it; a ``functools.partial`` is named after the
function it wraps), as in TRL's GRPO.

TRL GRPO's other reward conventions (``docs/coming-from-grpo.md``):

- during training the trainer also passes ``trainer_state`` (the ``transformers.TrainerState``), ``log_metric(name,
  value)`` (a scalar, averaged into the logged metrics) and ``log_extra(column, values)`` (one value per sample), as
  GRPO does, to every reward that names them or takes ``**kwargs``; a reward that does neither (``def fn(prompts,
  images, text)``) gets only the dataset columns, as before;
- an ``async def`` reward (or an instance whose ``__call__`` is ``async``) is awaited; all the async rewards of one
  call run concurrently (``asyncio.gather``) on one event loop in a daemon thread, which also works when the caller's
  thread already runs a loop (a notebook); the sync rewards run first, one after the other, as before;
- :func:`check_reward_signature` checks at construction that a reward can be called this way.

Scoring a batch (calling the rewards, awaiting the async ones, validating their values) is in
:mod:`marble_trl.rewards.scoring`.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from numbers import Real
from typing import Any

import torch

RewardFunc = Callable[..., Sequence[float | None]]

#: The keyword arguments the trainer passes besides ``prompts``, ``images`` and the dataset columns (as TRL's GRPO).
TRAINER_KWARGS = ("trainer_state", "log_extra", "log_metric")
#: Names a dataset column cannot have: the trainer passes keyword arguments of these names itself.
RESERVED_NAMES = ("prompts", "images", *TRAINER_KWARGS)


class RewardError(RuntimeError):
    """A reward function failed or returned values the trainer cannot use."""


def _unwrap_partial(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def reward_name(fn: RewardFunc) -> str:
    """The name a reward is logged under: ``__name__`` of a function or instance (of the wrapped function for a
    ``functools.partial``, as TRL's ``get_callable_name``), else its class name."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        name = getattr(_unwrap_partial(fn), "__name__", None)
    return name if isinstance(name, str) else type(_unwrap_partial(fn)).__name__


def is_async_reward(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` function, a ``functools.partial`` of one, or an
    instance whose ``__call__`` is ``async`` (TRL's ``is_async_callable``)."""
    fn = _unwrap_partial(fn)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: nothing to check
        return None


def accepted_trainer_kwargs(fn: Any) -> tuple[str, ...]:
    """The :data:`TRAINER_KWARGS` the trainer passes to ``fn``: all of them if it takes ``**kwargs`` (or its signature
    cannot be read), as TRL's GRPO passes them; otherwise those it names as keyword parameters."""
    sig = _signature(fn)
    if sig is None:
        return TRAINER_KWARGS
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return TRAINER_KWARGS
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(k for k in TRAINER_KWARGS if k in params and params[k].kind in keyword)


def dataset_columns(columns: Mapping[str, Any]) -> dict[str, Any]:
    """``columns`` without the :data:`TRAINER_KWARGS`: for a reward that takes ``**columns`` and forwards them all
    (to a server, a data frame) as per-sample lists."""
    return {key: value for key, value in columns.items() if key not in TRAINER_KWARGS}


def check_reward_columns(columns: Iterable[str]) -> None:
    """Raise if a dataset column has a name the trainer passes itself (``prompts``, ``images``, ``trainer_state``,
    ``log_extra``, ``log_metric``): a reward would receive that keyword twice."""
    clash = sorted(set(columns) & set(RESERVED_NAMES))
    if clash:
        raise ValueError(
            f"The dataset has column(s) {clash}, named like keyword arguments the trainer passes to every reward "
            f"({', '.join(RESERVED_NAMES)}); rename the column(s)."
        )


def check_reward_signature(fn: Any, name: str | None = None, columns: Iterable[str] | None = None) -> None:
    """Raise :class:`TypeError` naming the reward if ``fn`` cannot be called as the trainer calls it.

    The trainer calls ``fn(prompts=..., images=..., **columns)``, plus the :data:`TRAINER_KWARGS` that ``fn`` accepts
    (:func:`accepted_trainer_kwargs`). ``columns`` are the dataset's column names other than ``prompt``; when unknown
    (``None``, e.g. an ``IterableDataset``), only ``prompts``, ``images`` and unexpected keywords are checked, not
    missing ones. A class (rather than an instance) is refused: calling it would build an object, not return scores.
    """
    name = name or reward_name(fn)
    if inspect.isclass(fn):
        raise TypeError(
            f"Reward {name!r} is a class ({fn.__module__}.{fn.__qualname__}), not a reward: pass an instance "
            f"(`{fn.__qualname__}(...)`), or register it with `register_reward(..., factory=True)` so that it is "
            "built with its reward_kwargs."
        )
    if not callable(fn):
        raise TypeError(f"Reward {name!r} is a {type(fn).__name__}, not a callable.")
    sig = _signature(fn)
    if sig is None:
        return
    names = [c for c in columns if c != "prompt"] if columns is not None else []
    samples = "videos" if "videos" in sig.parameters else "images"  # a video-native reward (rewards.video)
    kwargs = dict.fromkeys(["prompts", samples, *names, *accepted_trainer_kwargs(fn)])
    try:
        if columns is not None:
            sig.bind(**kwargs)
        else:
            sig.bind_partial(**kwargs)
    except TypeError as err:
        given = f"the dataset's columns {names}" if columns is not None else "the dataset's columns"
        raise TypeError(
            f"Reward {name!r} cannot be called as the trainer calls it ({err}). Its signature is {name}{sig}; the "
            f"trainer passes the keyword arguments `prompts` (list[str]), `images` (a [B, 3, H, W] tensor) and one per "
            f"column other than 'prompt' ({given}), plus `trainer_state`, `log_extra` and `log_metric` to a reward "
            f"that names them or takes **kwargs. Write it as `def {name}(prompts, images, **columns)`."
        ) from err


def finite_numbers(values: Iterable[Any]) -> list[float]:
    """The finite real numbers among ``values`` (one-element tensors included; bools, ``None``, strings left out)."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value)):
            out.append(float(value))
    return out


def check_reward_funcs(
    reward_funcs: Sequence[Any], names: Sequence[str] | None = None, columns: Iterable[str] | None = None
) -> None:
    """:func:`check_reward_columns` on ``columns`` (when known), then :func:`check_reward_signature` on every reward."""
    columns = list(columns) if columns is not None else None
    if columns is not None:
        check_reward_columns(c for c in columns if c != "prompt")
    names = list(names) if names is not None else [reward_name(f) for f in reward_funcs]
    for fn, name in zip(reward_funcs, names):
        check_reward_signature(fn, name, columns)


class RewardLogs:
    """What the rewards of one :func:`~marble_trl.rewards.scoring.score_rewards` call logged through ``log_metric``
    and ``log_extra``.

    ``metrics`` maps a metric name to the values logged (GRPO averages them into the step's metrics); ``extras`` maps
    a column to one value per sample (GRPO adds them to its completions table). The trainer flushes both after
    scoring: it averages each metric over the processes into the logged metrics, and logs the mean of an extra
    column's numbers as ``extra/{column}`` (see ``docs/coming-from-grpo.md``).
    """

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extras: dict[str, list[Any]] = {}

    def log_metric_for(self, reward: str) -> Callable[[str, float], None]:
        """The ``log_metric(name, value)`` callable passed to ``reward``."""

        def log_metric(name: str, value: float) -> None:
            if not isinstance(name, str) or not name:
                raise RewardError(f"Reward {reward!r} called log_metric with name {name!r}; it must be a string.")
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, Real):
                raise RewardError(
                    f"Reward {reward!r} called log_metric({name!r}, {value!r}); the value must be a real number."
                )
            self.metrics[name].append(float(value))

        return log_metric

    def log_extra_for(self, reward: str, batch: int) -> Callable[[str, Sequence[Any]], None]:
        """The ``log_extra(column, values)`` callable passed to ``reward`` (one value per sample of ``batch``)."""

        def log_extra(column: str, values: Sequence[Any]) -> None:
            where = f"Reward {reward!r} called log_extra({column!r}, ...)"
            if not isinstance(column, str) or not column:
                raise RewardError(f"Reward {reward!r} called log_extra with column {column!r}; it must be a string.")
            if isinstance(values, (Mapping, Set, str, bytes)):
                raise RewardError(f"{where} with a {type(values).__name__}; pass a list with one value per sample.")
            values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
            if len(values) != batch:
                raise RewardError(f"{where} with {len(values)} values for {batch} samples; pass one per sample.")
            if column in self.extras:
                raise RewardError(f"{where}, but that column was already logged for this batch.")
            self.extras[column] = values

        return log_extra
