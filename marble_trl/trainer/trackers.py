"""Experiment trackers (``report_to``) for a diffusers model, and the images sent to them.

transformers' reporting callbacks (``transformers.integrations.integration_utils``) are written for transformers
models: at ``on_train_begin`` they read ``model.config`` as a ``PretrainedConfig``. The trainer's model is a diffusers
transformer whose ``config`` is a diffusers ``FrozenDict``, which has neither ``to_json_string`` (TensorBoard) nor
``to_dict`` (Comet, MLflow / DagsHub, Neptune, ClearML). :func:`adapt_model_config` gives the model's config those
methods (:class:`TrackerConfig`, still a ``FrozenDict``), so every integration reads it as it reads a transformers
config. wandb, Trackio and SwanLab read a ``dict`` config as it is.

Images (evaluation grids, and the captioned rollout grids of ``log_samples``) go to the TensorBoard, wandb and Trackio
callbacks of ``report_to``, found by type (a subclass of transformers' callback gets them too):
:func:`log_image`. The other integrations receive the scalars only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

import torch
from diffusers.configuration_utils import FrozenDict

# The rollout grid of ``log_samples``: the first prompts of the step (each a row of its first images), cells of at
# least 128 px (small images are scaled up) and at most 256 px (large ones are scaled down).
SAMPLE_GRID_PROMPTS = 4
SAMPLE_GRID_IMAGES = 8
_MAX_CELL = 256


def _jsonable(value: Any) -> Any:
    """``value`` with JSON types only (tuples and arrays as lists, paths and other objects as strings)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars, tensors
        return _jsonable(value.tolist())
    return str(value)


class TrackerConfig(FrozenDict):
    """A diffusers model config (a ``FrozenDict``) that also has the ``PretrainedConfig`` methods transformers'
    reporting integrations call: ``to_dict``, ``to_json_string`` and ``from_dict``."""

    def to_dict(self) -> dict[str, Any]:
        """The config as a new plain dict of JSON types."""
        return _jsonable(dict(self))

    def to_json_string(self, use_diff: bool = True) -> str:
        """The config as JSON, as ``PretrainedConfig.to_json_string`` writes it (``use_diff`` is accepted, not used:
        a diffusers config has no defaults to diff against)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> TrackerConfig:
        return cls({**config_dict, **kwargs})


def adapt_model_config(model: torch.nn.Module) -> None:
    """Give a diffusers model's config :class:`TrackerConfig`'s methods (in place; idempotent). A model without a
    diffusers config (e.g. a transformers model) is left as it is."""
    config = getattr(model, "_internal_dict", None)
    if isinstance(config, FrozenDict) and not isinstance(config, TrackerConfig):
        model._internal_dict = TrackerConfig(config)


def _callback_classes(*names: str) -> tuple[type, ...]:
    from transformers.integrations import integration_utils

    return tuple(getattr(integration_utils, n) for n in names if hasattr(integration_utils, n))


def tracker_callbacks(callbacks: Sequence[Any]) -> list[tuple[str, Any]]:
    """``(kind, callback)`` for each callback that can take images and is ready to: ``"tensorboard"`` (an open
    ``tb_writer``), ``"wandb"`` (a run) or ``"trackio"`` (initialised), found with ``isinstance`` against
    transformers' ``TensorBoardCallback`` / ``WandbCallback`` / ``TrackioCallback``."""
    (tensorboard,) = _callback_classes("TensorBoardCallback")
    (wandb,) = _callback_classes("WandbCallback")
    trackio = _callback_classes("TrackioCallback")  # transformers >= 4.55
    found = []
    for callback in callbacks:
        if isinstance(callback, tensorboard):
            if getattr(callback, "tb_writer", None) is not None:
                found.append(("tensorboard", callback))
        elif isinstance(callback, wandb):
            if getattr(getattr(callback, "_wandb", None), "run", None) is not None:
                found.append(("wandb", callback))
        elif trackio and isinstance(callback, trackio):
            if getattr(callback, "_initialized", False) and getattr(callback, "_trackio", None) is not None:
                found.append(("trackio", callback))
    return found


def log_image(
    callbacks: Sequence[Any], tag: str, image, step: int, caption: str | None = None, video=None
) -> list[str]:
    """Send a PIL ``image`` to the tracker callbacks (see :func:`tracker_callbacks`) under ``tag`` at optimizer step
    ``step``, with ``caption`` where the tracker shows one (wandb, Trackio; TensorBoard gets it as a text entry
    ``{tag}/caption``). A ``video`` file (mp4 / gif) goes to wandb and Trackio as well, under ``{tag}/video``
    (TensorBoard's add_video needs moviepy: it gets the image only). Returns the kinds of trackers it reached."""
    reached = []
    for kind, callback in tracker_callbacks(callbacks):
        if kind == "tensorboard":
            import numpy as np

            writer = callback.tb_writer
            writer.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")
            if caption:
                writer.add_text(f"{tag}/caption", caption, step)
            writer.flush()
        elif kind == "wandb":
            wandb = callback._wandb
            media = {f"{tag}/video": wandb.Video(str(video), caption=caption)} if video is not None else {}
            wandb.log({tag: wandb.Image(image, caption=caption), **media, "train/global_step": step})
        else:  # trackio: the callback logs its scalars with the same step key and trackio's own counter
            trackio = callback._trackio
            media = {}
            if video is not None and hasattr(trackio, "Video"):
                media = {f"{tag}/video": trackio.Video(str(video), caption=caption)}
            trackio.log({tag: trackio.Image(image, caption=caption), **media, "train/global_step": step})
        reached.append(kind)
    return reached


# ---------------------------------------------------------------------------------------------- rollout grids
def rollout_grid(
    images: torch.Tensor,
    prompts: Sequence[str],
    rewards: torch.Tensor,
    reward_names: Sequence[str],
    groups: Sequence[int] | None = None,
    title: str | None = None,
    max_prompts: int = SAMPLE_GRID_PROMPTS,
    max_images: int = SAMPLE_GRID_IMAGES,
):
    """A captioned grid of rollouts and its caption text. One row per group (a run of consecutive samples with the
    same ``groups`` id, by default the same prompt; this process's part of a group when it is split over processes),
    the first ``max_prompts`` groups and the first ``max_images`` images of each; the prompt labels the row and each
    image's rewards (``rewards[k, i]``; NaN, not applicable, shows as ``n/a``) are written under it. ``images`` are
    ``[N, 3, H, W]`` in ``[0, 1]``."""
    from ..evaluation.samples import captioned_grid

    keys = list(groups) if groups is not None else list(prompts)
    runs: list[list[int]] = []
    for i, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1].append(i)
        elif len(runs) < max_prompts:
            runs.append([i])
        else:
            break
    runs = [run[:max_images] for run in runs]
    columns = max(len(run) for run in runs)
    values = rewards.float().cpu()
    cells, scores, labels, lines = [], [], [], []
    for run in runs:
        labels.append(str(prompts[run[0]]))
        row = []
        for c in range(columns):
            if c < len(run):
                i = run[c]
                cells.append(images[i].float().cpu().clamp(0, 1))
                score = {n: (None if math.isnan(v) else v) for n, v in zip(reward_names, values[:, i].tolist())}
                row.append(", ".join(f"{n}={'n/a' if v is None else format(v, '.4g')}" for n, v in score.items()))
            else:  # a shorter row: a white cell
                cells.append(torch.ones_like(images[run[0]].float().cpu()))
                score = None
            scores.append(score)
        lines.append(f"{labels[-1]!r}: " + " | ".join(row))
    grid = captioned_grid(
        torch.stack(cells), columns, scores=scores, row_labels=labels, title=title, max_cell=_MAX_CELL
    )
    return grid, "\n".join(lines)
