"""What ``marble-trl train`` and the trainer print: the order of the logged keys and the end-of-training summary.

transformers' console printers (``ProgressCallback`` / ``PrinterCallback``) print each log dict in insertion order,
so :func:`order_logs` builds it with what a reader looks for first: ``loss``, ``reward``, each
``rewards/<name>/mean``, then the other metrics, and the timings (``*/time``, ``time/*``) last. Trackers and
``metrics.jsonl`` get the same keys and values; only the order changes. :func:`torch_threads` applies
``torch_num_threads`` for the duration of ``train()``.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

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
