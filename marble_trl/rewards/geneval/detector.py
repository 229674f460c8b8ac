"""GenEval's object detector on transformers: Mask2Former (Swin-S, COCO instance segmentation), without mmcv/mmdet.

GenEval runs mmdetection 2.x's ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``. The default here is the same
architecture and task in transformers, ``facebook/mask2former-swin-small-coco-instance`` (the original Mask2Former
authors' weights, converted), *not* mmdet's weights: detections, hence rewards, differ somewhat from the reference.
What is reproduced exactly is what mmdet does around the network (docs/rewards.md):

- input (mmdet's test pipeline): the uint8 image resized keeping its aspect ratio to fit (1333, 800) (bilinear, back
  to uint8), normalised with ImageNet's mean and std in 0-255 units, zero-padded to a multiple of 32;
- output (``MaskFormerFusionHead.instance_postprocess``): softmax over the classes without the no-object column, the
  top 100 (query, class) pairs, each pair's mask logits upsampled to the padded input, cropped to the resized image
  and upsampled to the original size (bilinear), binarised at > 0; score = class probability x mean sigmoid inside
  the mask; box = the mask's tight box, right and bottom exclusive (``mask2bbox``), ``[0, 0, 0, 0]`` for an empty mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .rules import Detection

# GenEval's class names (its object_names.txt), in COCO's contiguous label order.
GENEVAL_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
    "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
    "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster",
    "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
# The names COCO checkpoints (detectron2, mmdet, transformers) use where GenEval renamed the class.
LABEL_ALIASES = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    "tvmonitor": "tv",
    "tv monitor": "tv",
}
IMAGE_SCALE = (1333, 800)  # mmdet's test Resize: the long side at most 1333, the short side at most 800
SIZE_DIVISOR = 32
PIXEL_MEAN = (123.675, 116.28, 103.53)
PIXEL_STD = (58.395, 57.12, 57.375)
MAX_PER_IMAGE = 100


def _normalise(name: str) -> str:
    return " ".join(str(name).lower().replace("_", " ").replace("-", " ").split())


def geneval_labels(id2label: Mapping[Any, str]) -> list[str]:
    """The GenEval class name of each label id of a checkpoint, matched by name.

    Raises :class:`ValueError` unless the labels are exactly GenEval's 80 COCO classes (up to case, ``_``/``-`` and
    the renames of :data:`LABEL_ALIASES`): a detector with other classes (a panoptic checkpoint, ADE20K...) would give
    GenEval's thresholds another meaning.
    """
    labels = {int(k): v for k, v in id2label.items()}
    if sorted(labels) != list(range(len(labels))):
        raise ValueError(f"The detector's label ids must be 0..N-1, got {sorted(labels)[:10]}...")
    known = set(GENEVAL_CLASSES)
    names = [LABEL_ALIASES.get(_normalise(labels[i]), _normalise(labels[i])) for i in range(len(labels))]
    unknown = [labels[i] for i, n in enumerate(names) if n not in known]
    missing = sorted(known - set(names))
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if unknown or missing or duplicated:
        raise ValueError(
            "The GenEval reward needs a COCO instance-segmentation detector whose labels are GenEval's 80 classes "
            f"(e.g. facebook/mask2former-swin-small-coco-instance); this checkpoint's {len(labels)} labels do not map: "
            f"unknown {unknown[:10]}, missing {missing[:10]}, duplicated {duplicated[:10]}."
        )
    return names


def rescaled_size(height: int, width: int, scale: tuple[int, int] = IMAGE_SCALE) -> tuple[int, int]:
    """mmcv's keep-ratio rescale: the largest factor that fits the long side in max(scale) and the short side in
    min(scale); sizes rounded half up."""
    factor = min(max(scale) / max(height, width), min(scale) / min(height, width))
    return int(height * factor + 0.5), int(width * factor + 0.5)


def mask2bbox(masks: torch.Tensor) -> torch.Tensor:
    """``[N, H, W]`` bool masks -> ``[N, 4]`` float32 boxes ``[x1, y1, x2 + 1, y2 + 1]`` of their true pixels
    (``[0, 0, 0, 0]`` for an empty mask), as mmdet's ``mask2bbox``."""
    n, height, width = masks.shape
    cols, rows = masks.any(dim=1), masks.any(dim=2)  # [N, W], [N, H]
    # argmax returns the first maximal index: the first true column/row, from the left or (flipped) from the right.
    x1 = cols.to(torch.uint8).argmax(dim=1)
    x2 = width - cols.flip(1).to(torch.uint8).argmax(dim=1)
    y1 = rows.to(torch.uint8).argmax(dim=1)
    y2 = height - rows.flip(1).to(torch.uint8).argmax(dim=1)
    boxes = torch.stack([x1, y1, x2, y2], dim=1).float()
    return boxes * cols.any(dim=1, keepdim=True)


def instance_postprocess(
    class_logits: torch.Tensor,
    mask_logits: torch.Tensor,
    padded_hw: tuple[int, int],
    resized_hw: tuple[int, int],
    image_hw: tuple[int, int],
    max_per_image: int = MAX_PER_IMAGE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One image's raw outputs (``[Q, C + 1]`` class logits, ``[Q, h, w]`` mask logits) -> the top ``max_per_image``
    (query, class) pairs: ``labels [K]``, ``scores [K]`` (class prob x mask score), ``boxes [K, 4]``, and their masks
    as ``masks [U, H, W]`` bool with ``mask_index [K]`` into them (pairs of one query share its mask: U <= K).

    Only the queries that reach the top-K are upsampled; masks are computed per query, so this equals mmdet's
    upsampling of all queries.
    """
    probs = class_logits.float().softmax(dim=-1)[:, :-1]
    num_classes = probs.shape[1]
    top_probs, top = probs.flatten().topk(min(max_per_image, probs.numel()))
    labels, queries = top % num_classes, top // num_classes
    unique, mask_index = queries.unique(return_inverse=True)
    logits = mask_logits[unique].float()[:, None]
    logits = F.interpolate(logits, size=padded_hw, mode="bilinear", align_corners=False)
    logits = logits[..., : resized_hw[0], : resized_hw[1]]  # remove the padding
    logits = F.interpolate(logits, size=image_hw, mode="bilinear", align_corners=False)[:, 0]
    masks = logits > 0
    inside = masks.float()
    mask_scores = (logits.sigmoid() * inside).flatten(1).sum(1) / (inside.flatten(1).sum(1) + 1e-6)
    scores = top_probs * mask_scores[mask_index]
    boxes = mask2bbox(masks)[mask_index]
    return labels, scores, boxes, masks, mask_index


class Mask2FormerDetector:
    """A transformers ``Mask2FormerForUniversalSegmentation`` with mmdet's test pre- and post-processing.

    ``image_scale`` is mmdet's ``img_scale`` (default (1333, 800), GenEval's); ``reference_bgr=True`` swaps the
    channels before the network, as the RL reference (reward-server / DiffusionNFT) does by accident: it hands mmdet
    an RGB array that mmdet takes for BGR and flips.
    """

    def __init__(
        self, model: nn.Module, image_scale: tuple[int, int] = IMAGE_SCALE, reference_bgr: bool = False
    ) -> None:
        self.model = model
        self.class_names = geneval_labels(model.config.id2label)
        self.image_scale = (int(image_scale[0]), int(image_scale[1]))
        self.reference_bgr = bool(reference_bgr)

    def preprocess(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """uint8 ``[B, 3, H, W]`` RGB -> normalised, padded float32 ``[B, 3, Hp, Wp]`` and the unpadded resized size."""
        x = images.float()
        if self.reference_bgr:
            x = x.flip(1)
        resized = rescaled_size(x.shape[-2], x.shape[-1], self.image_scale)
        if resized != tuple(x.shape[-2:]):
            # cv2's bilinear resize of a uint8 image: no antialiasing, rounded back to uint8.
            x = F.interpolate(x, size=resized, mode="bilinear", align_corners=False).round().clamp(0, 255)
        mean = torch.tensor(PIXEL_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(PIXEL_STD, device=x.device).view(1, 3, 1, 1)
        x = (x - mean) / std
        pad_h, pad_w = (-resized[0]) % SIZE_DIVISOR, (-resized[1]) % SIZE_DIVISOR
        return F.pad(x, (0, pad_w, 0, pad_h)), resized

    def raw_outputs(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last decoder layer's ``[B, Q, C + 1]`` class logits and ``[B, Q, Hp / 4, Wp / 4]`` mask logits."""
        dtype = next(self.model.parameters()).dtype
        out = self.model(pixel_values=pixel_values.to(dtype))
        return out.class_queries_logits, out.masks_queries_logits

    def __call__(self, images: torch.Tensor) -> list[dict[str, list[Detection]]]:
        """uint8 ``[B, 3, H, W]`` RGB images -> per image, per GenEval class, its detections (float32 numpy boxes,
        float scores, ``[H, W]`` bool mask tensors on the images' device), unfiltered."""
        pixel_values, resized = self.preprocess(images)
        class_logits, mask_logits = self.raw_outputs(pixel_values)
        padded, image_hw = tuple(pixel_values.shape[-2:]), tuple(images.shape[-2:])
        out = []
        for b in range(images.shape[0]):
            labels, scores, boxes, masks, mask_index = instance_postprocess(
                class_logits[b], mask_logits[b], padded, resized, image_hw
            )
            per_class: dict[str, list[Detection]] = {}
            boxes_np = boxes.cpu().numpy().astype(np.float32)
            for k, (label, score, m) in enumerate(zip(labels.tolist(), scores.tolist(), mask_index.tolist())):
                det = Detection(boxes_np[k], score, masks[m])
                per_class.setdefault(self.class_names[label], []).append(det)
            out.append(per_class)
        return out


def load_mask2former(name_or_path: str, dtype: torch.dtype) -> nn.Module:
    """Load a Mask2Former checkpoint (a Hub id or a local folder); its labels are checked before its weights are
    read."""
    from .._lazy import require

    # transformers builds Mask2Former's training loss (Hungarian matching) in the constructor, which needs scipy.
    require("scipy", reward="geneval", hint='pip install "marble-trl[geneval]"')
    from transformers import AutoConfig, Mask2FormerForUniversalSegmentation

    geneval_labels(AutoConfig.from_pretrained(name_or_path).id2label)
    return Mask2FormerForUniversalSegmentation.from_pretrained(name_or_path, dtype=dtype)
