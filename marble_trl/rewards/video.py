"""The reward contract for videos (video families: Wan).

A video family's rollouts are videos ``[B, F, 3, H, W]`` in ``[0, 1]``. The trainer wraps every reward in
:class:`VideoReward`:

- a reward that names a ``videos`` parameter is *video-native*: it gets ``videos=[B, F, 3, H, W]`` (and ``images``,
  the frame chosen by ``video_reward_frames``, if it names that too);
- any other reward is an image reward, *lifted*: with ``video_reward_frames="mean"`` (default) it scores every frame
  (``B * F`` images, each prompt and column value repeated per frame) and a video's score is the mean over its frames
  that the reward scored (``None`` when it scored none); with ``"first"``, ``"middle"``, ``"last"`` or a frame index
  it scores that frame only.

:func:`temporal_consistency` is a video-native reward (classical: frame differences), registered by name.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch

from .base import _signature, accepted_trainer_kwargs, reward_name

FRAME_CHOICES = ("mean", "first", "middle", "last")


def takes_videos(fn: Any) -> bool:
    """Whether a reward is video-native (names a ``videos`` parameter)."""
    sig = _signature(fn)
    return sig is not None and "videos" in sig.parameters


def takes_images(fn: Any) -> bool:
    sig = _signature(fn)
    return sig is None or "images" in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def check_frames(frames: str | int) -> str | int:
    """``video_reward_frames`` as given: one of :data:`FRAME_CHOICES` or a frame index (as text from the CLI)."""
    if isinstance(frames, str) and frames.lstrip("-").isdigit():
        frames = int(frames)
    if isinstance(frames, int) or frames in FRAME_CHOICES:
        return frames
    raise ValueError(f"video_reward_frames={frames!r}: use one of {FRAME_CHOICES} or a frame index such as 0 or -1.")


def frame_index(frames: str | int, num_frames: int) -> int:
    """The frame a ``frames`` choice other than ``"mean"`` scores."""
    index = {"first": 0, "middle": num_frames // 2, "last": num_frames - 1}.get(frames, frames)
    if not -num_frames <= index < num_frames:
        raise ValueError(f"video_reward_frames={frames} is outside the videos' {num_frames} frames.")
    return index % num_frames


def still_frames(samples: torch.Tensor) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` for grids: the samples themselves, or each video's middle frame."""
    return samples[:, samples.shape[1] // 2] if samples.ndim == 5 else samples


class VideoReward:
    """A reward as the trainer calls it on videos (see the module docstring); keeps the reward's name."""

    def __init__(self, fn: Any, frames: str | int = "mean") -> None:
        self.fn = fn
        self.frames = check_frames(frames)
        self.__name__ = reward_name(fn)
        self.native = takes_videos(fn)
        self.trainer_kwargs = accepted_trainer_kwargs(fn)

    def __call__(self, prompts: list[str], images: torch.Tensor, **kwargs: Any):
        videos = images
        if videos.ndim != 5:
            raise ValueError(f"Reward {self.__name__!r}: expected videos [B, F, 3, H, W], got {tuple(videos.shape)}.")
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k in ("trainer_state", "log_extra", "log_metric")}
        extra = {k: v for k, v in extra.items() if k in self.trainer_kwargs}
        b, f = videos.shape[:2]
        if self.native:
            if takes_images(self.fn):
                kwargs["images"] = videos[:, frame_index("middle" if self.frames == "mean" else self.frames, f)]
            return self.fn(prompts=prompts, videos=videos, **kwargs, **extra)
        if self.frames != "mean":
            return self.fn(prompts=prompts, images=videos[:, frame_index(self.frames, f)], **kwargs, **extra)
        columns = {k: [v for v in values for _ in range(f)] for k, values in kwargs.items()}
        values = self.fn(
            prompts=[p for p in prompts for _ in range(f)], images=videos.flatten(0, 1), **columns, **extra
        )
        if inspect.isawaitable(values):
            return self._fold_later(values, b, f)
        return fold_frames(values, b, f)

    async def _fold_later(self, values, b: int, f: int):
        return fold_frames(await values, b, f)


def fold_frames(values: Sequence[Any], batch: int, frames: int) -> list[float | None] | Any:
    """Per-frame scores (``batch * frames``, video-major) -> each video's mean over the frames scored."""
    values = list(values)
    if len(values) != batch * frames:
        return values  # the wrong count: score_rewards reports it, naming the reward
    out: list[float | None] = []
    for i in range(batch):
        scored = [float(v) for v in values[i * frames : (i + 1) * frames] if v is not None and not _nan(v)]
        out.append(sum(scored) / len(scored) if scored else None)
    return out


def _nan(value: Any) -> bool:
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def as_video_rewards(reward_funcs: Sequence[Any], frames: str | int) -> list[VideoReward]:
    return [VideoReward(fn, frames) for fn in reward_funcs]


def temporal_consistency(prompts: list[str], videos: torch.Tensor, **_: Any) -> list[float]:
    """``1 - 2 * mean |frame_{t+1} - frame_t|`` clamped to [0, 1]: 1 for a still video, lower the more it
    flickers (a video-native reward; a still video maximises it, so pair it with content rewards)."""
    if videos.shape[1] < 2:
        return [1.0] * len(prompts)
    change = (videos[:, 1:] - videos[:, :-1]).abs().float().mean(dim=(1, 2, 3, 4))
    return (1.0 - 2.0 * change).clamp(0.0, 1.0).tolist()
