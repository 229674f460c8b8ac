"""Weight-based preference rewards: CLIPScore, PickScore, LAION aesthetic and HPSv2.1 (ImageReward: imagereward.py).

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

import html
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .registry import register_reward

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


def hps_transform(images: torch.Tensor, size: int) -> torch.Tensor:
    """HPSv2's evaluation resize: longest side to ``size`` (bicubic), zero-pad to a square; then CLIP normalisation.

    HPSv2's ``preprocess_val`` is ``ToTensor()`` then ``ResizeMaxSize`` then ``Normalize``: the resize runs on the
    float tensor (torchvision's tensor ``resize``: antialiased bicubic, no clamping of the overshoot), not on a PIL
    image, so unlike :class:`ImageTransform` nothing is clamped to ``[0, 1]`` here.
    """
    x = images.float()
    h, w = x.shape[-2:]
    scale = size / float(max(h, w))
    if scale != 1.0:
        nh, nw = round(h * scale), round(w * scale)
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
        ph, pw = size - nh, size - nw
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
    mean = torch.tensor(OPENAI_CLIP_MEAN, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD, device=x.device).view(1, -1, 1, 1)
    return (x - mean) / std


def _pooled(out: Any) -> torch.Tensor:
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

    def __init__(self, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32", batch_size: int = 32):
        self.__name__ = self.reward_name
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        if int(batch_size) < 1:
            raise ValueError(f"Reward {self.reward_name!r}: batch_size must be >= 1, got {batch_size}.")
        self.batch_size = int(batch_size)
        self._loaded = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r}, dtype={self.dtype}, batch_size={self.batch_size})"

    def load(self) -> None:
        """Load the weights now (otherwise done on the first call)."""
        if not self._loaded:
            self._load()
            self._loaded = True

    def _freeze(self, module: nn.Module) -> nn.Module:
        return module.requires_grad_(False).eval().to(device=self.device, dtype=self.dtype)

    def _load(self) -> None:
        raise NotImplementedError

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, prompts: list[str], images: torch.Tensor, **_: object) -> list[float]:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"Reward {self.reward_name!r} expects images [B, 3, H, W], got {tuple(images.shape)}.")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"Reward {self.reward_name!r}: {len(prompts)} prompts for {images.shape[0]} images.")
        self.load()
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(prompts), self.batch_size):
                chunk = images[start : start + self.batch_size].to(self.device, torch.float32)
                scores.extend(
                    self._score(list(prompts[start : start + self.batch_size]), chunk).float().cpu().tolist()
                )
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
    ) -> None:
        super().__init__(device, dtype, batch_size)
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
        image = _pooled(self.model.get_image_features(pixel_values=pixel_values)).float()
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        text = _pooled(self.model.get_text_features(**tokens.to(self.device))).float()
        return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


@register_reward("clipscore", factory=True)
class CLIPScore(_CLIPReward):
    """Cosine similarity of CLIP ViT-L/14 image and prompt embeddings, in ``[-1, 1]`` (typically 0.15-0.40).

    flow_grpo logs ``logit_scale * cos / 30`` (= ``100 cos / 30``) instead: the same ranking, a different scale.
    """

    reward_name = "clipscore"
    default_model = "openai/clip-vit-large-patch14"

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        image, text = self._embeddings(prompts, pixels)
        return (image * text).sum(-1)


@register_reward("pickscore", factory=True)
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


@register_reward("aesthetic", factory=True)
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
    ) -> None:
        super().__init__(device, dtype, batch_size)
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
        self.mlp = mlp.requires_grad_(False).eval().to(self.device)

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        embeds = _pooled(self.vision.get_image_features(pixel_values=self.transform(pixels).to(self.dtype))).float()
        return self.mlp(F.normalize(embeds, dim=-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------------
# HPSv2.1 (open_clip checkpoint, run on transformers' CLIPModel)


def _split_open_clip_block(sd: dict[str, torch.Tensor], src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    # open_clip's nn.MultiheadAttention packs q, k, v in one in_proj; transformers' CLIP has three Linear layers.
    for kind in ("weight", "bias"):
        q, k, v = sd[f"{src}.attn.in_proj_{kind}"].chunk(3, dim=0)
        out[f"{dst}.self_attn.q_proj.{kind}"] = q
        out[f"{dst}.self_attn.k_proj.{kind}"] = k
        out[f"{dst}.self_attn.v_proj.{kind}"] = v
        out[f"{dst}.self_attn.out_proj.{kind}"] = sd[f"{src}.attn.out_proj.{kind}"]
        out[f"{dst}.layer_norm1.{kind}"] = sd[f"{src}.ln_1.{kind}"]
        out[f"{dst}.layer_norm2.{kind}"] = sd[f"{src}.ln_2.{kind}"]
        out[f"{dst}.mlp.fc1.{kind}"] = sd[f"{src}.mlp.c_fc.{kind}"]
        out[f"{dst}.mlp.fc2.{kind}"] = sd[f"{src}.mlp.c_proj.{kind}"]


def open_clip_to_transformers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert an open_clip ``CLIP`` state dict (ViT towers, no LayerScale) to transformers' ``CLIPModel`` keys."""
    sd = {k.removeprefix("module."): v for k, v in state_dict.items()}
    out: dict[str, torch.Tensor] = {}
    for tower, src_root, dst_root in (
        ("vision", "visual.transformer.resblocks", "vision_model.encoder.layers"),
        ("text", "transformer.resblocks", "text_model.encoder.layers"),
    ):
        n_layers = len({k[len(src_root) + 1 :].split(".")[0] for k in sd if k.startswith(src_root + ".")})
        if n_layers == 0:
            raise KeyError(f"No {tower} transformer blocks ({src_root}.N.*) in the checkpoint.")
        for i in range(n_layers):
            _split_open_clip_block(sd, f"{src_root}.{i}", f"{dst_root}.{i}", out)
    out["vision_model.embeddings.patch_embedding.weight"] = sd["visual.conv1.weight"]
    out["vision_model.embeddings.class_embedding"] = sd["visual.class_embedding"]
    out["vision_model.embeddings.position_embedding.weight"] = sd["visual.positional_embedding"]
    for kind in ("weight", "bias"):
        out[f"vision_model.pre_layrnorm.{kind}"] = sd[f"visual.ln_pre.{kind}"]
        out[f"vision_model.post_layernorm.{kind}"] = sd[f"visual.ln_post.{kind}"]
        out[f"text_model.final_layer_norm.{kind}"] = sd[f"ln_final.{kind}"]
    # open_clip projects with x @ proj (a [width, embed] Parameter); transformers with a bias-free Linear.
    out["visual_projection.weight"] = sd["visual.proj"].t().contiguous()
    text_proj = sd.get("text_projection.weight")  # open_clip's text_projection is a Linear in some configs
    out["text_projection.weight"] = text_proj if text_proj is not None else sd["text_projection"].t().contiguous()
    out["text_model.embeddings.token_embedding.weight"] = sd["token_embedding.weight"]
    out["text_model.embeddings.position_embedding.weight"] = sd["positional_embedding"]
    out["logit_scale"] = sd["logit_scale"].reshape(())
    return out


def ftfy_fix_text() -> Callable[[str], str] | None:
    """``ftfy.fix_text`` when ftfy is installed, else ``None``."""
    try:
        from ftfy import fix_text
    except ImportError:
        return None
    return fix_text


def open_clip_clean(text: str, fix_text: Callable[[str], str] | None) -> str:
    """open_clip's (so HPSv2's) prompt cleaning before BPE: its ``basic_clean`` then ``whitespace_clean``.

    ``fix_text`` (``ftfy.fix_text``: curly quotes, ligatures, full-width letters, mojibake...; ``None`` skips it),
    HTML entities unescaped twice, whitespace runs collapsed to one space, stripped. transformers' CLIP tokenizer does
    none of this (it NFC-normalises, collapses whitespace and lower-cases), so without it a prompt such as
    ``a sign “OPEN” &amp; lit`` would tokenise differently from HPSv2's.
    """
    import regex  # a transformers dependency; open_clip's \s is the regex module's (re's differs on U+001C-U+001F)

    if fix_text is not None:
        text = fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return regex.sub(r"\s+", " ", text).strip()


@register_reward("hpsv2", factory=True)
class HPSv2Score(ModelReward):
    """HPSv2.1: cosine of image and prompt embeddings of the HPS-finetuned open_clip ViT-H-14 (typically 0.2-0.35).

    Options: ``model_name_or_path`` (a local ``.pt`` file, a folder holding ``filename``, or a Hub repo; default
    ``xswu/HPSv2``), ``filename`` (``HPS_v2.1_compressed.pt``; ``HPS_v2_compressed.pt`` for v2.0),
    ``clip_name_or_path`` (a transformers CLIP repo/folder whose config and tokenizer match the checkpoint's
    architecture; only its config and tokenizer files are read; default ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``),
    plus device/dtype/batch. The checkpoint's ``state_dict`` is converted to ``CLIPModel`` keys on load.
    Preprocessing is HPSv2's ``preprocess_val`` on the float tensor (:func:`hps_transform`): longest side to 224
    (antialiased bicubic, unclamped), zero padding to square, CLIP normalisation; prompts are cleaned as open_clip's
    tokenizer does (:func:`open_clip_clean`; ftfy's step only where ftfy is installed) before transformers' tokenizer.
    """

    reward_name = "hpsv2"

    def __init__(
        self,
        model_name_or_path: str = "xswu/HPSv2",
        filename: str = "HPS_v2.1_compressed.pt",
        clip_name_or_path: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int = 32,
    ) -> None:
        super().__init__(device, dtype, batch_size)
        self.model_name_or_path = model_name_or_path
        self.filename = filename
        self.clip_name_or_path = clip_name_or_path

    def checkpoint_path(self) -> str:
        """The local checkpoint file (downloaded from the Hub when ``model_name_or_path`` is a repo id)."""
        if os.path.isfile(self.model_name_or_path):
            return self.model_name_or_path
        if os.path.isdir(self.model_name_or_path):
            return os.path.join(self.model_name_or_path, self.filename)
        from huggingface_hub import hf_hub_download

        return hf_hub_download(self.model_name_or_path, self.filename)

    def _load(self) -> None:
        from transformers import AutoTokenizer, CLIPConfig, CLIPModel

        path = self.checkpoint_path()
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        state = checkpoint.get("state_dict", checkpoint)
        try:
            converted = open_clip_to_transformers(state)
        except KeyError as err:
            raise RuntimeError(
                f"Reward 'hpsv2': {path} is not an open_clip CLIP state dict (no key {err}); expected HPSv2's "
                "checkpoint, a dict with a 'state_dict' entry."
            ) from err
        config = CLIPConfig.from_pretrained(self.clip_name_or_path)
        model, info = CLIPModel.from_pretrained(
            None, config=config, state_dict=converted, dtype=self.dtype, output_loading_info=True
        )
        missing = [k for k in info["missing_keys"] if not k.endswith("position_ids")]
        if missing or info.get("mismatched_keys"):
            raise RuntimeError(
                f"Reward 'hpsv2': the checkpoint does not fit the architecture of {self.clip_name_or_path!r} "
                f"(missing {missing[:5]}, mismatched {list(info.get('mismatched_keys') or [])[:5]})."
            )
        self.model = self._freeze(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.clip_name_or_path)
        # open_clip pools the text tower at argmax(token id) (the end-of-text token is the highest id); transformers'
        # CLIP does the same when eos_token_id == 2 (configs predating transformers PR 24773) and otherwise pools at the
        # first token equal to eos_token_id, which must then be the tokenizer's: else it silently pools position 0.
        eos = config.text_config.eos_token_id
        if eos != 2 and eos != self.tokenizer.eos_token_id:
            raise RuntimeError(
                f"Reward 'hpsv2': {self.clip_name_or_path!r} has text_config.eos_token_id={eos} but its tokenizer's "
                f"end-of-text token is {self.tokenizer.eos_token_id}: the text features would be pooled at the wrong "
                "position. Fix eos_token_id in config.json (or use a config whose eos_token_id is 2)."
            )
        self._fix_text = ftfy_fix_text()
        if self._fix_text is None:
            logger.warning(
                "Reward 'hpsv2': ftfy is not installed, so prompts are not ftfy-fixed as HPSv2's tokenizer does "
                "(curly quotes, ligatures, full-width characters...); `pip install ftfy` to follow it exactly."
            )
        self.image_size = int(config.vision_config.image_size)
        self.max_length = int(config.text_config.max_position_embeddings)

    def tokenize(self, prompts: list[str]) -> Any:
        """The prompts as HPSv2's tokenizer reads them (``input_ids``/``attention_mask`` on the reward's device)."""
        self.load()
        # split_special_tokens: laion's HF tokenizers declare "!" as their pad token, which would otherwise turn every "!"
        # in a prompt into a special token; open_clip's tokenizer (HPSv2's reference) reads it as text.
        return self.tokenizer(
            [open_clip_clean(p, self._fix_text) for p in prompts],
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
            split_special_tokens=True,
        ).to(self.device)

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        pixel_values = hps_transform(pixels, self.image_size).to(self.dtype)
        image = _pooled(self.model.get_image_features(pixel_values=pixel_values)).float()
        text = _pooled(self.model.get_text_features(**self.tokenize(prompts))).float()
        return (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)
