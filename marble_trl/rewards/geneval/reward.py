"""The in-process GenEval reward: the Mask2Former detector, CLIP colours and GenEval's rules, in the training process.

By default each image's value is the partial-credit ``score`` of the RL reward (reward-server / DiffusionNFT
``evaluate_reward``), the GenEval reward MARBLE trains on; ``metric: correct`` gives GenEval's binary benchmark metric
and ``metric: strict`` the RL reward's ``strict_correct``. Rows without GenEval metadata score ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..clip_family import ModelReward
from .colour import ColourClassifier
from .detector import IMAGE_SCALE, Mask2FormerDetector, load_mask2former
from .metadata import row_metadata
from .rules import METRICS, Detection, geneval_value

DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
DEFAULT_CLIP = "openai/clip-vit-large-patch14"


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` floats in ``[0, 1]`` -> uint8, as the reference quantises before its models."""
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8)


class GenEvalReward(ModelReward):
    """GenEval in the training process (docs/rewards.md, "In-process GenEval").

    Options:
        detector_name_or_path: a Mask2Former COCO instance checkpoint (Hub id or local folder), default
            ``facebook/mask2former-swin-small-coco-instance``; its labels must be GenEval's 80 classes.
        clip_name_or_path: the CLIP model and tokenizer of the colour check, default ``openai/clip-vit-large-patch14``.
        metric: ``"score"`` (default, partial credit, can be negative), ``"correct"`` (GenEval's benchmark metric,
            1.0 / 0.0) or ``"strict"`` (the RL reward's strict_correct, 1.0 / 0.0).
        name: the name in logs (default ``"geneval"``).
        detector_image_scale: mmdet's resize target (default (1333, 800), GenEval's); smaller is faster but no
            longer the reference's input.
        reference_bgr: feed the detector channel-swapped images, as the RL reference does by accident (default False).
        device, dtype, batch_size (images per detector pass, default 8), offload: as for the other model rewards.
    """

    reward_name = "geneval"

    def __init__(
        self,
        detector_name_or_path: str = DEFAULT_DETECTOR,
        clip_name_or_path: str = DEFAULT_CLIP,
        metric: str = "score",
        name: str = "geneval",
        detector_image_scale: Sequence[int] = IMAGE_SCALE,
        reference_bgr: bool = False,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int = 8,
        offload: bool = False,
    ) -> None:
        super().__init__(device, dtype, batch_size, offload)
        if metric not in METRICS:
            raise ValueError(f"Reward {name!r}: metric must be one of {METRICS}, got {metric!r}.")
        scale = tuple(int(s) for s in detector_image_scale)
        if len(scale) != 2 or min(scale) < 1:
            raise ValueError(f"Reward {name!r}: detector_image_scale must be two positive sizes, got {scale!r}.")
        self.__name__ = name
        self.detector_name_or_path = detector_name_or_path
        self.clip_name_or_path = clip_name_or_path
        self.metric = metric
        self.detector_image_scale = scale
        self.reference_bgr = bool(reference_bgr)

    def __repr__(self) -> str:
        return (
            f"GenEvalReward(metric={self.metric!r}, detector={self.detector_name_or_path!r}, "
            f"clip={self.clip_name_or_path!r}, device={str(self.device)!r}, dtype={self.dtype})"
        )

    def _load(self) -> None:
        from transformers import AutoTokenizer, CLIPModel

        self.detector_model = self._freeze(load_mask2former(self.detector_name_or_path, self.dtype))
        self.detector = Mask2FormerDetector(self.detector_model, self.detector_image_scale, self.reference_bgr)
        self.clip_model = self._freeze(CLIPModel.from_pretrained(self.clip_name_or_path, dtype=self.dtype))
        self.colours = ColourClassifier(self.clip_model, AutoTokenizer.from_pretrained(self.clip_name_or_path))

    def _value(self, detections: dict[str, list[Detection]], image: np.ndarray, metadata: dict[str, Any]) -> float:
        def colour_of(objects: Sequence[Detection], classname: str) -> list[str]:
            return self.colours(image, objects, classname)

        return geneval_value(detections, metadata, colour_of, self.metric)

    def __call__(self, prompts: list[str], images: torch.Tensor, **columns: Any) -> list[float | None]:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"Reward {self.__name__!r} expects images [B, 3, H, W], got {tuple(images.shape)}.")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"Reward {self.__name__!r}: {len(prompts)} prompts for {images.shape[0]} images.")
        metadata = row_metadata(columns, len(prompts))
        rows = [i for i, meta in enumerate(metadata) if meta is not None]
        scores: list[float | None] = [None] * len(prompts)
        if not rows:  # nothing to score: the models are not even loaded
            return scores
        self.load()
        if self.offload:
            self._place(self.device)
        try:
            with torch.no_grad():
                for start in range(0, len(rows), self.batch_size):
                    chunk = rows[start : start + self.batch_size]
                    pixels = images[chunk].to(self.device, torch.float32)
                    if torch.isnan(pixels).any():  # uint8 would turn NaN into a black image and hide the fault
                        raise ValueError(f"Reward {self.__name__!r}: the images contain NaN (a diverged model?).")
                    uint8 = to_uint8(pixels)
                    detections = self.detector(uint8)
                    hwc = uint8.permute(0, 2, 3, 1).cpu().numpy()
                    for j, i in enumerate(chunk):
                        scores[i] = self._value(detections[j], hwc[j], metadata[i])
        finally:
            if self.offload:
                self._place(self.home)
        return scores
