"""What ``marble-trl train`` and the trainer print: one compact line per log, the order of the logged keys, and the
end-of-training summary.

The console prints :func:`compact_line` per log (``console_format="compact"``, the default): the step, the loss, each
reward's mean, MARBLE's ``alpha_bar``, the time per step and the time left, under transformers' progress bar
(:class:`CompactProgressCallback`; :class:`CompactPrinterCallback` without one). Trackers and ``metrics.jsonl`` get the
full dict, whose order :func:`order_logs` sets: ``loss``, ``reward``, each ``rewards/<name>/mean``, the other metrics,
the timings (``*/time``, ``time/*``) last (``console_format="full"`` prints that dict, transformers' way).
:func:`torch_threads` applies ``torch_num_threads`` for the duration of ``train()``.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

from transformers.trainer_callback import PrinterCallback, ProgressCallback

_FIRST = ("loss", "reward", "reward_std")
_MEAN = re.compile(r"^rewards/[^/]+/mean$")
_EVAL_MEAN = re.compile(r"^eval(_[^/]*)?_rewards/[^/]+/mean$")


def _rank(key: str) -> int:
    if key in _FIRST:
        return _FIRST.index(key)
    if _MEAN.match(key):
        return 10
    if key.endswith("_composite") or key.startswith("eval_composite") or _EVAL_MEAN.match(key):
        return 11
    if key.startswith("time/") or key.endswith("/time") or key.endswith("_runtime") or key == "epoch":
        return 30
    return 20


def order_logs(logs: dict[str, Any]) -> dict[str, Any]:
    """Reorder ``logs`` in place (and return it): loss, reward, rewards/*/mean (eval: composite and eval means) first,
    the rest in their order, timings last. Stable within each rank."""
    ordered = sorted(logs.items(), key=lambda kv: _rank(kv[0]))  # sorted() is stable
    logs.clear()
    logs.update(ordered)
    return logs


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def compact_line(logs: dict[str, Any], step: int, max_steps: int, seconds_per_step: float | None) -> str:
    """One console line for a log: ``step 10/28 | loss 58.27 | pickscore 0.4148, ocr 0.6146 | alpha_bar 0.45 0.31 0.24
    | 1.6 s/step | ETA 0:00:29``; an evaluation: its composite and its rewards' means; the end of training: its
    runtime and loss."""
    parts = [f"step {step}/{max_steps}"]
    if "train_runtime" in logs:  # the Trainer's summary at the end
        parts.append(f"done in {_duration(logs['train_runtime'])}")
        if "train_loss" in logs:
            parts.append(f"train_loss {_fmt(logs['train_loss'])}")
        return " | ".join(parts)
    evals = {k: v for k, v in logs.items() if _EVAL_MEAN.match(k)}
    if evals or any(k.endswith("_composite") for k in logs):
        parts[0] = f"eval at step {step}"
        for key in (k for k in logs if k.endswith("_composite") or k.endswith("_mean_reward")):
            parts.append(f"{key.split('_', 1)[-1]} {_fmt(logs[key])}")
        parts.append(", ".join(f"{k.split('/')[1]} {_fmt(v)}" for k, v in evals.items()))
        return " | ".join(p for p in parts if p)
    if "loss" in logs:
        parts.append(f"loss {_fmt(logs['loss'])}")
    means = [(k.split("/")[1], v) for k, v in logs.items() if _MEAN.match(k) and isinstance(v, (int, float))]
    if means:
        parts.append(", ".join(f"{name} {_fmt(v)}" for name, v in means))
    alpha = [v for k, v in logs.items() if k.startswith("marble/alpha_bar/") and isinstance(v, (int, float))]
    if alpha:
        parts.append("alpha_bar " + " ".join(f"{a:.2f}" for a in alpha))
    if "nonfinite/skipped_steps" in logs and logs["nonfinite/skipped_steps"]:
        parts.append(f"skipped {_fmt(logs['nonfinite/skipped_steps'])}")
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step:.3g} s/step")
        if max_steps > step:
            parts.append(f"ETA {_duration(seconds_per_step * (max_steps - step))}")
    return " | ".join(parts)


class _StepClock:
    """Seconds per optimizer step over the steps since the previous log (first log: since training began)."""

    def __init__(self) -> None:
        self.time, self.step = 0.0, 0

    def start(self, step: int) -> None:
        import time

        self.time, self.step = time.perf_counter(), step

    def per_step(self, step: int) -> float | None:
        import time

        now = time.perf_counter()
        done = step - self.step
        rate = (now - self.time) / done if done > 0 else None
        if done > 0:
            self.time, self.step = now, step
        return rate


class CompactProgressCallback(ProgressCallback):
    """transformers' progress bar, with :func:`compact_line` instead of the whole log dict above it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock = _StepClock()

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.start(state.global_step)
        return super().on_train_begin(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            rate = self.clock.per_step(state.global_step)
            self.training_bar.write(compact_line(logs, state.global_step, state.max_steps, rate))


class CompactPrinterCallback(PrinterCallback):
    """transformers' printer (``disable_tqdm=True``), with :func:`compact_line` instead of the log dict."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = _StepClock()

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.start(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            logs = {k: v for k, v in logs.items() if k != "total_flos"}
            print(compact_line(logs, state.global_step, state.max_steps, self.clock.per_step(state.global_step)))


def reward_summary_lines(log_history: Sequence[dict[str, Any]], prefix: str = "[marble-trl]") -> list[str]:
    """One line per reward: its first and last logged mean (training ``rewards/<name>/mean``, then evaluation
    ``eval*_rewards/<name>/mean``) with their steps and the change, e.g.
    ``[marble-trl] rewards/brightness/mean: 0.4653 (step 10) -> 0.5101 (step 60), +0.0448``."""
    first: dict[str, tuple[int, float]] = {}
    last: dict[str, tuple[int, float]] = {}
    for entry in log_history:
        step = int(entry.get("step", 0))
        for key, value in entry.items():
            if not (_MEAN.match(key) or _EVAL_MEAN.match(key)) or not isinstance(value, (int, float)):
                continue
            if math.isnan(value):
                continue
            first.setdefault(key, (step, float(value)))
            last[key] = (step, float(value))
    keys = sorted(first, key=lambda k: (not _MEAN.match(k), list(first).index(k)))
    lines = []
    for key in keys:
        (s0, v0), (s1, v1) = first[key], last[key]
        if s0 == s1 and not _MEAN.match(key):
            continue  # an evaluation logged once (e.g. eval_before_after's): nothing to compare
        lines.append(f"{prefix} {key}: {_fmt(v0)} (step {s0}) -> {_fmt(v1)} (step {s1}), {v1 - v0:+.4g}")
    return lines


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to ``num_threads`` inside (unchanged when ``None``), restored on exit."""
    if num_threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def use_compact_console(trainer) -> None:
    """Swap transformers' console printer of ``trainer`` (progress bar or printer) for the compact one."""
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(CompactProgressCallback)
    elif trainer.pop_callback(PrinterCallback) is not None:
        trainer.add_callback(CompactPrinterCallback)
