"""OCR reward (flow_grpo's text-rendering reward) on RapidOCR, which ships its ONNX models in the wheel: offline.

Target text = the text between the first pair of double quotes in the prompt (``None``, i.e. not applicable, for
prompts without one). Reward = ``1 - min(d, n) / n`` where ``n`` is the target length and ``d`` the Levenshtein
distance between the recognised text and the target, both lowercased with spaces removed, and ``d = 0`` when the
target is a substring of the recognised text. In ``[0, 1]``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch

from ._lazy import require
from .images import to_uint8_numpy

logger = logging.getLogger(__name__)

_QUOTED = re.compile(r'"([^"]*)"')
_INSTALL_HINT = 'pip install "marble-trl[ocr]"  (i.e. pip install rapidocr onnxruntime)'


def quoted_text(prompt: str) -> str | None:
    """The text between the first pair of double quotes, or ``None`` if the prompt has no (non-empty) quoted text."""
    match = _QUOTED.search(prompt)
    if match is None or not match.group(1).strip():
        return None
    return match.group(1)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions), two-row dynamic programming."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_similarity(recognised: str, target: str) -> float:
    """flow_grpo's OCR score of ``recognised`` text against ``target`` (see the module docstring)."""
    recognised = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if not target:
        raise ValueError("The OCR target text is empty.")
    dist = 0 if target in recognised else levenshtein(recognised, target)
    # Many unrelated characters cost at most the whole target, as in flow_grpo.
    return 1.0 - min(dist, len(target)) / len(target)


class OCRReward:
    """Text-rendering accuracy of the quoted text in the prompt, read back with RapidOCR.

    Options:
        device: ``"cpu"`` (default) or ``"cuda"`` (needs ``onnxruntime-gpu`` instead of ``onnxruntime``).
        text_score: drop recognised boxes below this confidence (0.5, as PaddleOCR's ``drop_score`` in flow_grpo).
        use_cls: run the text-angle classifier (off, as ``use_angle_cls=False`` in flow_grpo).
        det_limit_side_len, det_limit_type: the detector's input resize, PaddleOCR's defaults (960, ``"max"``: only
            images whose longest side exceeds 960 are shrunk). RapidOCR's own defaults (736, ``"min"``) upscale
            every image to a 736-pixel shortest side, several times slower.
        params: extra RapidOCR parameters (``{"Det.box_thresh": 0.6, ...}``), applied last.

    The engine is built on the first call (model files are read from the installed wheel; nothing is downloaded).
    """

    def __init__(
        self,
        device: str = "cpu",
        text_score: float = 0.5,
        use_cls: bool = False,
        det_limit_side_len: int = 960,
        det_limit_type: str = "max",
        params: dict[str, Any] | None = None,
    ) -> None:
        self.__name__ = "ocr"
        device = str(device)
        if device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"Reward 'ocr': device must be 'cpu' or 'cuda', got {device!r}.")
        self.device = device
        self.params: dict[str, Any] = {
            "Global.log_level": "error",
            "Global.text_score": float(text_score),
            "Global.use_cls": bool(use_cls),
            "Det.limit_side_len": int(det_limit_side_len),
            "Det.limit_type": str(det_limit_type),
        }
        if device.startswith("cuda"):
            self.params["EngineConfig.onnxruntime.use_cuda"] = True
            if ":" in device:
                self.params["EngineConfig.onnxruntime.cuda_ep_cfg.device_id"] = int(device.split(":")[1])
        self.params.update(params or {})
        self._engine: Any = None

    def load(self) -> None:
        """Build the RapidOCR engine now (otherwise done on the first call)."""
        if self._engine is None:
            rapidocr = require("rapidocr", reward="ocr", hint=_INSTALL_HINT)
            self._engine = rapidocr.RapidOCR(params=self.params)

    def recognise(self, image_bgr: np.ndarray) -> str:
        """All text RapidOCR reads in one ``[H, W, 3]`` uint8 BGR image, boxes joined in reading order."""
        self.load()
        result = self._engine(image_bgr)
        return "".join(result.txts) if result.txts else ""

    def __call__(self, prompts: list[str], images: torch.Tensor, **_: object) -> list[float | None]:
        targets = [quoted_text(p) for p in prompts]
        if all(t is None for t in targets):
            return [None] * len(prompts)
        arrays = to_uint8_numpy(images)
        scores: list[float | None] = []
        for target, rgb in zip(targets, arrays):
            if target is None:
                scores.append(None)
                continue
            # RapidOCR (like OpenCV) takes arrays as BGR.
            bgr = np.ascontiguousarray(rgb[..., ::-1])
            try:
                text = self.recognise(bgr)
            except ImportError:
                raise
            except Exception as err:  # flow_grpo gives an unreadable image the maximum penalty rather than failing
                logger.warning("RapidOCR failed on an image (%s: %s); scoring it 0.", type(err).__name__, err)
                text = ""
            scores.append(ocr_similarity(text, target))
        return scores
