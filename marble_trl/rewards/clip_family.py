"""Weight-based preference rewards: CLIPScore, PickScore and LAION aesthetic (HPSv2.1: hpsv2.py; ImageReward:
imagereward.py), and their shared base class.

Common behaviour (see docs/rewards.md):

- options ``model_name_or_path`` (a Hub id, defaulting to the reference model, or a local path), ``device``
  (``"cpu"``, ``"cuda"``, ``"cuda:1"``...), ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``) and
  ``batch_size`` (images per forward pass);
- weights load on the first call (or on ``.load()``), so building the reward list costs nothing and each process
  loads onto its own device; the model is frozen (``requires_grad_(False)``), in eval mode, run under ``no_grad``;
- images are preprocessed from the ``[B, 3, H, W]`` float tensor in ``[0, 1]`` on the reward's device, following the
  checkpoint's image processor (resize, centre crop, normalise): no PIL or uint8 round trip.

CLIP, PickScore, aesthetic and HPSv2.1 run on ``transformers``' ``CLIPModel`` (HPSv2.1's open_clip checkpoint is
converted on load, so ``open_clip`` is not needed). ImageReward (``imagereward.py``) shares the base class.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# CLIP's (OpenAI's) normalisation constants: used by HPSv2 and ImageReward, whose preprocessing is fixed in code.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}.") from None


# ---------------------------------------------------------------------------------------------------------------------
# Preprocessing from the [B, 3, H, W] float tensor in [0, 1]


def _size_field(size: Any, key: str) -> Any:
    # transformers' image processors hold sizes as dicts (older) or SizeDict objects (5.x).
    if size is None:
        return None
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)


def _resize(x: torch.Tensor, hw: tuple[int, int], mode: str) -> torch.Tensor:
    if tuple(x.shape[-2:]) == hw:
        return x
    # antialias=True follows PIL (and torchvision) when downsampling; clamp as PIL does when it rounds to uint8.
    return F.interpolate(x, size=hw, mode=mode, align_corners=False, antialias=True).clamp(0.0, 1.0)


def _center_crop(x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    h, w = x.shape[-2:]
    ch, cw = hw
    if h < ch or w < cw:  # pad with zeros first, as transformers' center_crop does
        ph, pw = max(ch - h, 0), max(cw - w, 0)
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        h, w = x.shape[-2:]
    top, left = (h - ch) // 2, (w - cw) // 2
    return x[..., top : top + ch, left : left + cw]


class ImageTransform:
    """CLIP-style preprocessing on tensors: shortest-edge (or fixed-size) resize, centre crop, normalisation."""

    def __init__(
        self,
        resize: int | tuple[int, int] | None,
        crop: tuple[int, int] | None,
        mean: Sequence[float],
        std: Sequence[float],
        mode: str = "bicubic",
    ) -> None:
        self.resize, self.crop, self.mode = resize, crop, mode
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1)

    @classmethod
    def from_image_processor(cls, processor: Any) -> ImageTransform:
        """Read the resize/crop/normalise settings of a transformers image processor (e.g. ``CLIPImageProcessor``)."""
        resize: int | tuple[int, int] | None = None
        if getattr(processor, "do_resize", True):
            size = processor.size
            if isinstance(size, int):
                resize = size
            elif _size_field(size, "shortest_edge") is not None:
                resize = int(_size_field(size, "shortest_edge"))
            else:
                resize = (int(_size_field(size, "height")), int(_size_field(size, "width")))
        crop: tuple[int, int] | None = None
        if getattr(processor, "do_center_crop", False):
            cs = processor.crop_size
            crop = (cs, cs) if isinstance(cs, int) else (int(_size_field(cs, "height")), int(_size_field(cs, "width")))
        if getattr(processor, "do_normalize", True):
            mean, std = processor.image_mean, processor.image_std
        else:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        # PIL's BILINEAR is 2; CLIP processors use BICUBIC (3). Anything else is treated as bicubic.
        resample = getattr(processor, "resample", 3)
        mode = "bilinear" if resample in (2, "bilinear") or getattr(resample, "value", None) == 2 else "bicubic"
        return cls(resize, crop, mean, std, mode)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float()
        if isinstance(self.resize, int):
            h, w = x.shape[-2:]
            short, long = (h, w) if h <= w else (w, h)
            new_long = int(self.resize * long / short)  # transformers' rounding for shortest-edge resizes
            x = _resize(x, (self.resize, new_long) if h <= w else (new_long, self.resize), self.mode)
        elif self.resize is not None:
            x = _resize(x, self.resize, self.mode)
        if self.crop is not None:
            x = _center_crop(x, self.crop)
        return (x - self.mean.to(x.device)) / self.std.to(x.device)


def pooled_features(out: Any) -> torch.Tensor:
    # CLIPModel.get_*_features return a tensor in transformers 4 and an output object (pooler_output) in 5.
    return out if isinstance(out, torch.Tensor) else out.pooler_output


# ---------------------------------------------------------------------------------------------------------------------
# The shared reward shell


class ModelReward:
    """Base of the weight-based rewards: options, lazy loading, batching, device/dtype placement.

    Subclasses set ``reward_name`` and implement :meth:`_load` and :meth:`_score` (``prompts`` and a ``[b, 3, H, W]``
    float32 chunk in ``[0, 1]`` already on ``self.device`` -> ``[b]`` scores).
    """

    reward_name = "model_reward"

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int = 32,
        offload: bool = False,
    ):
        self.__name__ = self.reward_name
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        if int(batch_size) < 1:
            raise ValueError(f"Reward {self.reward_name!r}: batch_size must be >= 1, got {batch_size}.")
        self.batch_size = int(batch_size)
        # offload: the weights live in CPU memory and visit `device` only while a call scores (the trainer scores
        # once per step, between rollouts and training, so the accelerator holds them only then).
        self.offload = bool(offload)
        self._loaded = False

    def __repr__(self) -> str:
        offload = ", offload=True" if self.offload else ""
        return (
            f"{type(self).__name__}(device={str(self.device)!r}, dtype={self.dtype}, batch_size={self.batch_size}"
            f"{offload})"
        )

    @property
    def home(self) -> torch.device:
        """Where the weights stay between calls: the CPU when offloaded, else ``device``."""
        return torch.device("cpu") if self.offload else self.device

    def modules(self) -> list[nn.Module]:
        """The loaded frozen models (every ``nn.Module`` attribute)."""
        return [v for v in vars(self).values() if isinstance(v, nn.Module)]

    def _place(self, device: torch.device) -> None:
        for module in self.modules():
            module.to(device)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def load(self) -> None:
        """Load the weights now (otherwise done on the first call)."""
        if not self._loaded:
            self._load()
            self._loaded = True

    def _freeze(self, module: nn.Module) -> nn.Module:
        return module.requires_grad_(False).eval().to(device=self.home, dtype=self.dtype)

    def _load(self) -> None:
        raise NotImplementedError

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
        self.check_images(prompts, images)

        def score(part: slice) -> torch.Tensor:
            return self._score(list(prompts[part]), images[part].to(self.device, torch.float32))

        return self.batched(len(prompts), score)

    def check_images(self, prompts: list[str], images: torch.Tensor) -> None:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"Reward {self.reward_name!r} expects images [B, 3, H, W], got {tuple(images.shape)}.")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"Reward {self.reward_name!r}: {len(prompts)} prompts for {images.shape[0]} images.")

    def batched(self, count: int, score) -> list[float]:
        """``score(part)`` over ``batch_size`` slices of ``count`` samples, without gradients, the weights loaded (and
        on the device while scoring when offloaded)."""
        self.load()
        scores: list[float] = []
        if self.offload:
            self._place(self.device)
        try:
            with torch.no_grad():
                for start in range(0, count, self.batch_size):
                    scores.extend(score(slice(start, start + self.batch_size)).float().cpu().tolist())
        finally:
            if self.offload:
                self._place(self.home)
        return scores


class _CLIPReward(ModelReward):
    """A transformers ``CLIPModel`` with its tokenizer and image processor; scores from normalised embeddings."""

    default_model = "openai/clip-vit-large-patch14"
    default_processor: str | None = None  # None: the model's own folder/repo

    def __init__(
        self,
        model_name_or_path: str | None = None,
        processor_name_or_path: str | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int = 32,
        offload: bool = False,
    ) -> None:
        super().__init__(device, dtype, batch_size, offload)
        self.model_name_or_path = model_name_or_path or self.default_model
        self.processor_name_or_path = processor_name_or_path or self.default_processor or self.model_name_or_path

    def _load(self) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        self.model = self._freeze(CLIPModel.from_pretrained(self.model_name_or_path, dtype=self.dtype))
        self.tokenizer = AutoTokenizer.from_pretrained(self.processor_name_or_path)
        self.transform = ImageTransform.from_image_processor(
            AutoImageProcessor.from_pretrained(self.processor_name_or_path)
        )
        self.max_length = int(self.model.config.text_config.max_position_embeddings)

    def _embeddings(self, prompts: list[str], pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit-norm float32 image and text embeddings, ``[b, d]`` each."""
        pixel_values = self.transform(pixels).to(self.dtype)
        image = pooled_features(self.model.get_image_features(pixel_values=pixel_values)).float()
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        text = pooled_features(self.model.get_text_features(**tokens.to(self.device))).float()
        return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


class CLIPScore(_CLIPReward):
    """Cosine similarity of CLIP ViT-L/14 image and prompt embeddings, in ``[-1, 1]`` (typically 0.15-0.40).

    flow_grpo logs ``logit_scale * cos / 30`` (= ``100 cos / 30``) instead: the same ranking, a different scale.
    """

    reward_name = "clipscore"
    default_model = "openai/clip-vit-large-patch14"

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        image, text = self._embeddings(prompts, pixels)
        return (image * text).sum(-1)


class PickScore(_CLIPReward):
    """PickScore v1: ``logit_scale.exp() * cos(image, prompt) / 26`` (flow_grpo's scaling; typically ~0.8-0.9)."""

    reward_name = "pickscore"
    default_model = "yuvalkirstain/PickScore_v1"
    default_processor = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        image, text = self._embeddings(prompts, pixels)
        return self.model.logit_scale.exp().float() * (image * text).sum(-1) / 26.0


# ---------------------------------------------------------------------------------------------------------------------
# LAION aesthetic predictor v2


AESTHETIC_MLP_URL = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac%2Blogos%2Bava1-l14-linearMSE.pth"
)
AESTHETIC_MLP_FILE = "sac+logos+ava1-l14-linearMSE.pth"


class AestheticMLP(nn.Module):
    """The improved-aesthetic-predictor head; module indices match the released state dict (``layers.0.weight``...)."""

    def __init__(self, input_size: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


class AestheticScore(ModelReward):
    """LAION aesthetic predictor v2: unit-norm CLIP ViT-L/14 image embedding -> MLP; roughly 1-10 (SD images ~5-6).

    Options: ``model_name_or_path`` (the CLIP model), ``mlp_path`` (a local ``.pth`` or an http(s) URL, downloaded
    once to torch's hub cache; default: the released ``sac+logos+ava1-l14-linearMSE.pth``), plus device/dtype/batch.
    The MLP runs in float32 whatever ``dtype`` the CLIP tower uses.
    """

    reward_name = "aesthetic"

    def __init__(
        self,
        model_name_or_path: str = "openai/clip-vit-large-patch14",
        mlp_path: str = AESTHETIC_MLP_URL,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int = 32,
        offload: bool = False,
    ) -> None:
        super().__init__(device, dtype, batch_size, offload)
        self.model_name_or_path = model_name_or_path
        self.mlp_path = mlp_path

    def _load(self) -> None:
        from transformers import AutoImageProcessor, CLIPModel

        # The full CLIPModel, not CLIPVisionModelWithProjection: the latter reads projection_dim from the vision
        # sub-config, which some CLIP configs leave at its default, and would then silently re-initialise the projection.
        self.vision = self._freeze(CLIPModel.from_pretrained(self.model_name_or_path, dtype=self.dtype))
        self.transform = ImageTransform.from_image_processor(
            AutoImageProcessor.from_pretrained(self.model_name_or_path)
        )
        if self.mlp_path.startswith(("http://", "https://")):
            state = torch.hub.load_state_dict_from_url(
                self.mlp_path, map_location="cpu", file_name=AESTHETIC_MLP_FILE, weights_only=True
            )
        else:
            state = torch.load(self.mlp_path, map_location="cpu", weights_only=True)
        mlp = AestheticMLP(int(state["layers.0.weight"].shape[1]))
        mlp.load_state_dict(state)
        self.mlp = mlp.requires_grad_(False).eval().to(self.home)

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        embeds = pooled_features(
            self.vision.get_image_features(pixel_values=self.transform(pixels).to(self.dtype))
        ).float()
        return self.mlp(F.normalize(embeds, dim=-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------------
# HPSv2.1 (open_clip checkpoint, run on transformers' CLIPModel)
