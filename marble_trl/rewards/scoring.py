"""Scoring a batch: :func:`score_rewards` calls every reward as the trainer does and validates what it returns.

The sync rewards run first, in order; the async ones are then awaited concurrently on one event loop in a daemon thread
(:func:`_reward_loop`). Each reward's return value is checked (:func:`_store`: one real, finite, float32-range number
or ``None`` per sample) and written into a ``[K, B]`` float32 tensor, NaN where a reward does not apply; a reward that
writes into the images it was given is refused (:func:`check_images_unchanged`). The contract itself, the signature
checks and :class:`~marble_trl.rewards.base.RewardLogs` are in :mod:`marble_trl.rewards.base`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Mapping, Sequence, Set
from numbers import Real
from typing import Any

import torch

from .base import RewardError, RewardFunc, RewardLogs, accepted_trainer_kwargs, reward_name

FLOAT32_MAX = torch.finfo(torch.float32).max


# The event loop that runs async rewards: one per process, in a daemon thread started on first use (TRL's GRPO starts
# one the same way). A persistent loop keeps loop-bound clients (an aiohttp session) usable from one step to the next.
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _reward_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                ready.set()
                loop.run_forever()

            threading.Thread(target=run, name="marble-trl-async-rewards", daemon=True).start()
            ready.wait()
            _LOOP = loop
        return _LOOP


def _await_all(awaitables: list[Any]) -> list[Any]:
    """Await ``awaitables`` concurrently; each gives ``(values, seconds)`` or the exception it raised."""
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    async def one(awaitable: Any) -> tuple[Any, float]:
        # Grad mode and the current CUDA device are per thread: give the loop's thread the caller's.
        torch.set_grad_enabled(grad)
        if device is not None:
            torch.cuda.set_device(device)
        start = time.perf_counter()
        values = await awaitable
        return values, time.perf_counter() - start

    async def gather_all() -> list[Any]:
        return await asyncio.gather(*(one(a) for a in awaitables), return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather_all(), _reward_loop()).result()


def score_rewards(
    reward_funcs: Sequence[RewardFunc],
    prompts: list[str],
    images: torch.Tensor,
    columns: dict[str, list[Any]] | None = None,
    names: Sequence[str] | None = None,
    timings: dict[str, float] | None = None,
    *,
    trainer_state: Any = None,
    logs: RewardLogs | None = None,
) -> torch.Tensor:
    """Call every reward and return a ``[K, B]`` float32 tensor, NaN where a reward does not apply.

    If ``timings`` is given, it receives each reward's scoring time in seconds, keyed by name (for an async reward,
    its own time, which overlaps the other async rewards').

    With ``trainer_state`` or ``logs`` given (the trainer gives both), every reward that names them or takes
    ``**kwargs`` also gets GRPO's ``trainer_state``, ``log_extra`` and ``log_metric``; what it logs lands in ``logs``.
    The sync rewards are called in order; the async ones are then awaited, all of them concurrently.

    Raises :class:`RewardError` naming the reward (and the sample index and prompt, when one sample is at fault) if a
    reward raises, returns something other than a sequence of values (a dict, a set, a string, ...), the wrong number
    of values, a non-numeric value, NaN, an infinite value, or one beyond float32's range (about 3.4e38).
    """
    columns = columns or {}
    names = list(names) if names is not None else [reward_name(f) for f in reward_funcs]
    batch = len(prompts)
    out = torch.full((len(reward_funcs), batch), float("nan"), dtype=torch.float32)  # NaN: "not applicable"
    grpo = trainer_state is not None or logs is not None
    if grpo and logs is None:
        logs = RewardLogs()

    def failed(name: str, err: BaseException) -> RewardError:
        # re-raised with the reward's name: the user must know which one broke
        return RewardError(
            f"Reward {name!r} raised {type(err).__name__}: {err} (batch of {batch} prompts, first: {prompts[0]!r})."
        )

    pending: list[tuple[int, str, Any]] = []  # the async rewards' (row, name, awaitable)
    for k, (fn, name) in enumerate(zip(reward_funcs, names)):
        extra: dict[str, Any] = {}
        if grpo:
            for key in accepted_trainer_kwargs(fn):
                if key == "trainer_state":
                    extra[key] = trainer_state
                elif key == "log_extra":
                    extra[key] = logs.log_extra_for(name, batch)
                else:
                    extra[key] = logs.log_metric_for(name)
        start = time.perf_counter()
        version = images._version if isinstance(images, torch.Tensor) else None
        sources = columns.get("source_images")  # an editing model's: guarded as the images are
        source_version = sources._version if isinstance(sources, torch.Tensor) else None
        try:
            values = fn(prompts=prompts, images=images, **columns, **extra)
        except RewardError:
            raise
        except Exception as err:
            raise failed(name, err) from err
        if inspect.isawaitable(values):  # an async reward: run with the others below
            pending.append((k, name, values))
            continue
        check_images_unchanged(images, version, name)
        check_images_unchanged(sources, source_version, name)
        if timings is not None:
            timings[name] = time.perf_counter() - start
        _store(out, k, name, values, prompts)
    if pending:
        version = images._version if isinstance(images, torch.Tensor) else None
        results = _await_all([awaitable for _, _, awaitable in pending])
        check_images_unchanged(images, version, " or ".join(repr(name) for _, name, _ in pending), quoted=True)
        for (k, name, _), result in zip(pending, results):
            if isinstance(result, BaseException):
                if isinstance(result, RewardError) or not isinstance(result, Exception):
                    raise result  # already named; or KeyboardInterrupt, CancelledError, ...
                raise failed(name, result) from result
            values, seconds = result
            if timings is not None:
                timings[name] = seconds
            _store(out, k, name, values, prompts)
    return out


def check_images_unchanged(images: Any, version: int | None, name: str, quoted: bool = False) -> None:
    """A reward must not write into the images it gets: every later reward (and the logged samples) would see what it
    wrote. torch counts in-place writes on a tensor (``_version``)."""
    if version is not None and images._version != version:
        who = name if quoted else repr(name)
        raise RewardError(
            f"Reward {who} modified the images it was given in place (e.g. `images.mul_(...)`, `images[...] = ...`): "
            "the rewards after it would score the modified images. Work on a copy (`images = images.clone()`) or "
            "use out-of-place operations."
        )


def _store(out: torch.Tensor, k: int, name: str, values: Any, prompts: list[str]) -> None:
    """Validate one reward's return value and write it into row ``k`` of ``out`` (``None`` stays NaN)."""
    batch = len(prompts)
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
