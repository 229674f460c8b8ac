"""ImageReward v1.0 on transformers' BLIP classes, without the ``image-reward`` package.

ImageReward (THUDM, 2023) is BLIP's ViT-L/16 image encoder (224 px) and its BERT-base text encoder, whose layers
cross-attend to the image tokens; an MLP 768-1024-128-64-16-1 reads the text encoder's ``[CLS]`` output and the score
is standardised as ``(mlp - 0.16717362830052426) / 1.0333394966054072`` (the package's ``ImageReward.score_gard``).

Here the ViT runs as ``transformers.BlipVisionModel`` and the text encoder as ``BlipTextModel`` (cross-attention
layers on), the way ``BlipForImageTextRetrieval`` wires its ``vision_model`` and ``text_encoder``. The released
``ImageReward.pt`` (keys ``blip.visual_encoder.*``, ``blip.text_encoder.*``, ``mlp.layers.*``) is converted on load
by :func:`imagereward_to_transformers`, the key mapping of transformers' original-BLIP conversion script.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .clip_family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, AestheticMLP, ImageTransform, ModelReward

logger = logging.getLogger(__name__)

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
# ImageReward.__init__: the MLP output is standardised with these (ImageReward/ImageReward.py, image-reward 1.5).
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
# Prompts are tokenised with padding="max_length", truncation=True, max_length=35 (ImageReward.score).
IMAGEREWARD_MAX_LENGTH = 35

# BLIP's configs/med_config.json, which ImageReward ships as med_config.json. Its encoder_width is replaced by the
# ViT's width on load (BLIP_Pretrain sets encoder_config.encoder_width = vision_width).
IMAGEREWARD_MED_CONFIG: dict[str, Any] = {
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 768,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "model_type": "bert",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 30524,
    "encoder_width": 768,
    "add_cross_attention": True,
}

# BLIP's create_vit("large", 224): timm-style ViT-L/16, qkv bias, exact GELU, LayerNorm eps 1e-6, final norm.
IMAGEREWARD_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-6,
}

# Checkpoint entries the score does not use: BLIP's contrastive projections, and the text encoder's position_ids
# buffer (persistent in BLIP's med.py, rebuilt by transformers).
_UNUSED_SUFFIXES = ("embeddings.position_ids",)
_UNUSED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
_USED_PREFIXES = ("blip.visual_encoder.", "blip.text_encoder.", "mlp.")

# blip.visual_encoder.blocks.{i}.<src> -> vision_model.encoder.layers.{i}.<dst>
_VIT_BLOCK_MAP = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VIT_TOP_MAP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}


def _vit_key(name: str) -> str:
    """A key of BLIP's ViT (without ``blip.visual_encoder.``) -> ``BlipVisionModel``'s key."""
    if name in _VIT_TOP_MAP:
        return _VIT_TOP_MAP[name]
    if name.startswith("blocks."):
        _, index, rest = name.split(".", 2)
        for src, dst in _VIT_BLOCK_MAP.items():
            if rest.startswith(src + "."):
                return f"encoder.layers.{int(index)}.{dst}{rest[len(src) :]}"
    raise KeyError(name)


def imagereward_key(key: str) -> str | None:
    """The converted name of one ``ImageReward.pt`` key: ``vision_model.*``, ``text_encoder.*`` or ``mlp.*``.

    Returns ``None`` for entries the score does not use (``blip.vision_proj``, ``blip.text_proj``, ``position_ids``);
    raises ``KeyError`` for a key it does not know.
    """
    if key.startswith(_UNUSED_PREFIXES) or key.endswith(_UNUSED_SUFFIXES):
        return None
    if key.startswith("blip.visual_encoder."):
        return "vision_model." + _vit_key(key.removeprefix("blip.visual_encoder."))
    if key.startswith("blip.text_encoder."):
        # BLIP's med.py BertModel and transformers' BlipTextModel share their module names (embeddings.*,
        # encoder.layer.{i}.attention/crossattention/intermediate/output.*); BLIP_Pretrain has no pooler.
        rest = key.removeprefix("blip.text_encoder.")
        if rest.startswith("pooler."):
            raise KeyError(key)
        return "text_encoder." + rest
    if key.startswith("mlp.layers."):
        return key
    raise KeyError(key)


def imagereward_to_transformers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert an ``ImageReward.pt`` state dict to :class:`ImageRewardModel` keys.

    Keys under ``blip.visual_encoder.``, ``blip.text_encoder.`` and ``mlp.`` must all be known (a ``KeyError``
    otherwise); ``blip.vision_proj``/``blip.text_proj``/``position_ids`` are dropped; any other top-level entry is
    ignored with a warning, as ``ImageReward.load`` (``strict=False``) ignores it.
    """
    out: dict[str, torch.Tensor] = {}
    ignored = []
    for key, value in state_dict.items():
        if not key.startswith(_USED_PREFIXES) and not key.startswith(_UNUSED_PREFIXES):
            ignored.append(key)
            continue
        try:
            new = imagereward_key(key)
        except KeyError:
            raise KeyError(f"Unknown ImageReward checkpoint key {key!r}.") from None
        if new is not None:
            out[new] = value
    if ignored:
        logger.warning("ImageReward: ignoring %d checkpoint entries outside the scorer: %s", len(ignored), ignored[:5])
    return out


def load_med_config(med_config: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """BLIP's med config as a dict: ``None`` (ImageReward's), a dict, or a path to a ``med_config.json``."""
    if med_config is None:
        return dict(IMAGEREWARD_MED_CONFIG)
    if isinstance(med_config, Mapping):
        return dict(med_config)
    with open(med_config, encoding="utf-8") as f:
        return json.load(f)


def text_config_from_med(med: Mapping[str, Any], encoder_hidden_size: int) -> Any:
    """``BlipTextConfig`` for BLIP's med.py ``BertModel`` config (cross-attention to a ``encoder_hidden_size`` ViT)."""
    from transformers import BlipTextConfig

    if not med.get("add_cross_attention", False):
        raise ValueError(
            "ImageReward's med config must have add_cross_attention=true (the text encoder reads the image)."
        )
    if med.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"Only absolute position embeddings are supported, got {med['position_embedding_type']!r}.")
    return BlipTextConfig(
        vocab_size=int(med["vocab_size"]),
        hidden_size=int(med["hidden_size"]),
        encoder_hidden_size=int(encoder_hidden_size),
        intermediate_size=int(med["intermediate_size"]),
        num_hidden_layers=int(med["num_hidden_layers"]),
        num_attention_heads=int(med["num_attention_heads"]),
        max_position_embeddings=int(med["max_position_embeddings"]),
        hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=float(med.get("layer_norm_eps", 1e-12)),
        hidden_dropout_prob=float(med.get("hidden_dropout_prob", 0.0)),
        attention_probs_dropout_prob=float(med.get("attention_probs_dropout_prob", 0.0)),
        initializer_range=float(med.get("initializer_range", 0.02)),
        pad_token_id=int(med.get("pad_token_id", 0)),
        bos_token_id=None,  # generation-only ids of BLIP's decoder; the encoder does not use them
        eos_token_id=None,
        sep_token_id=None,
        is_decoder=True,  # in BlipTextModel, is_decoder is what builds the cross-attention layers
        use_cache=False,
    )


class ImageRewardModel(nn.Module):
    """BLIP ViT + BLIP text encoder (cross-attention) + the MLP head; ``forward`` returns standardised scores ``[b]``.

    The MLP runs in float32 on the float32 ``[CLS]`` feature whatever the towers' dtype.
    """

    def __init__(self, vision_config: Any, text_config: Any, mlp_input_size: int | None = None) -> None:
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        self.vision_model = BlipVisionModel(vision_config)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        self.mlp = AestheticMLP(mlp_input_size or text_config.hidden_size)  # ImageReward's MLP: same layers and keys
        self.mean, self.std = IMAGEREWARD_MEAN, IMAGEREWARD_STD

    @classmethod
    def from_original(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        med_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        vision_config: Mapping[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> ImageRewardModel:
        """Build from an ``ImageReward.pt`` state dict; every weight of the model must come from the checkpoint."""
        from transformers import BlipVisionConfig

        converted = imagereward_to_transformers(state_dict)
        vcfg = BlipVisionConfig(**{**IMAGEREWARD_VISION_CONFIG, **dict(vision_config or {})})
        tcfg = text_config_from_med(load_med_config(med_config), vcfg.hidden_size)
        mlp_in = converted.get("mlp.layers.0.weight")
        if mlp_in is not None and mlp_in.shape[1] != tcfg.hidden_size:
            raise RuntimeError(
                f"ImageReward: the MLP head reads {mlp_in.shape[1]} features but med_config's text encoder has "
                f"hidden_size {tcfg.hidden_size}."
            )
        with torch.device("meta"):
            model = cls(vcfg, tcfg, None if mlp_in is None else int(mlp_in.shape[1]))
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(converted)), sorted(set(converted) - expected)
        mismatched = [
            f"{k}: checkpoint {tuple(converted[k].shape)} vs model {tuple(v.shape)}"
            for k, v in model.state_dict().items()
            if k in converted and tuple(converted[k].shape) != tuple(v.shape)
        ]
        if missing or unexpected or mismatched:
            raise RuntimeError(
                "ImageReward: the checkpoint does not fit the configured architecture (check med_config and "
                f"vision_config): missing {missing[:5]}, unexpected {unexpected[:5]}, mismatched {mismatched[:5]}."
            )
        model.load_state_dict(converted, strict=True, assign=True)
        # Non-persistent buffers are not in the state dict: rebuild them off the meta device.
        emb = model.text_encoder.embeddings
        emb.position_ids = torch.arange(emb.position_ids.shape[-1]).expand((1, -1))
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"ImageReward: tensors left uninitialised after loading: {left[:5]}.")
        model.vision_model.to(dtype)
        model.text_encoder.to(dtype)
        model.mlp.float()
        return model.requires_grad_(False).eval()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor
    ) -> torch.Tensor:
        image_embeds = self.vision_model(pixel_values=pixel_values).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_atts,
        ).last_hidden_state
        rewards = self.mlp(text[:, 0, :].float()).squeeze(-1)
        return (rewards - self.mean) / self.std


class ImageRewardTransform:
    """ImageReward's ``_transform(size)`` on ``[B, 3, H, W]`` tensors in ``[0, 1]``.

    torchvision ``Resize(size, BICUBIC)`` (shortest side to ``size``, the long side ``int(size * long / short)``;
    antialiased bicubic like PIL), ``CenterCrop(size)`` with torchvision's offsets ``round((H - size) / 2)`` (not
    transformers' floor division), then CLIP normalisation.
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._resize_normalise = ImageTransform(self.size, None, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, "bicubic")

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = self._resize_normalise(images)  # normalisation is per pixel, so cropping after it is the same
        h, w = x.shape[-2:]
        top, left = int(round((h - self.size) / 2.0)), int(round((w - self.size) / 2.0))
        return x[..., top : top + self.size, left : left + self.size]


def init_tokenizer(name_or_path: str) -> Any:
    """BLIP's ``init_tokenizer``: a BERT tokenizer plus the ``[DEC]`` (bos) and ``[ENC]`` special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


class ImageRewardScore(ModelReward):
    """ImageReward v1.0: BLIP image-text features -> MLP, standardised by ImageReward's mean/std (roughly -2..2).

    Options: ``model_name_or_path`` (a local ``ImageReward.pt``, a folder holding it, or a Hub repo; default
    ``THUDM/ImageReward``; ``"ImageReward-v1.0"`` is accepted as an alias), ``tokenizer_name_or_path`` (default
    ``bert-base-uncased``; a local folder works), ``med_config`` (BLIP's text-encoder config: a dict or a
    ``med_config.json`` path; default ImageReward's), ``vision_config`` (overrides of the ViT-L/16 224 px config,
    for other-sized checkpoints), plus device/dtype/batch_size. Runs on transformers' BLIP classes, converted on
    load: the ``image-reward`` package is not needed. Preprocessing is the package's ``_transform(224)`` on tensors:
    shortest side to 224 (bicubic, antialiased), centre crop, CLIP normalisation.
    """

    reward_name = "imagereward"

    def __init__(
        self,
        model_name_or_path: str = IMAGEREWARD_REPO,
        tokenizer_name_or_path: str = "bert-base-uncased",
        med_config: str | Mapping[str, Any] | None = None,
        vision_config: Mapping[str, Any] | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int = 32,
        offload: bool = False,
    ) -> None:
        super().__init__(device, dtype, batch_size, offload)
        self.model_name_or_path = IMAGEREWARD_REPO if model_name_or_path == "ImageReward-v1.0" else model_name_or_path
        self.tokenizer_name_or_path = tokenizer_name_or_path
        self.med_config = med_config
        self.vision_config = dict(vision_config or {})
        size = int(self.vision_config.get("image_size", IMAGEREWARD_VISION_CONFIG["image_size"]))
        self.transform = ImageRewardTransform(size)

    def checkpoint_path(self) -> str:
        """The local ``ImageReward.pt`` (downloaded from the Hub when ``model_name_or_path`` is a repo id)."""
        if os.path.isfile(self.model_name_or_path):
            return self.model_name_or_path
        if os.path.isdir(self.model_name_or_path):
            return os.path.join(self.model_name_or_path, IMAGEREWARD_FILE)
        from huggingface_hub import hf_hub_download

        return hf_hub_download(self.model_name_or_path, IMAGEREWARD_FILE)

    def _load(self) -> None:
        state = torch.load(self.checkpoint_path(), map_location="cpu", weights_only=True)
        model = ImageRewardModel.from_original(state, self.med_config, self.vision_config, self.dtype)
        self.model = model.to(self.home)
        self.tokenizer = init_tokenizer(self.tokenizer_name_or_path)
        vocab = self.model.text_encoder.config.vocab_size
        if len(self.tokenizer) > vocab:
            raise ValueError(
                f"Reward 'imagereward': the tokenizer {self.tokenizer_name_or_path!r} has {len(self.tokenizer)} "
                f"tokens with [DEC]/[ENC], more than the text encoder's {vocab} embeddings."
            )

    def _score(self, prompts: list[str], pixels: torch.Tensor) -> torch.Tensor:
        tokens = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=IMAGEREWARD_MAX_LENGTH, return_tensors="pt"
        ).to(self.device)
        pixel_values = self.transform(pixels).to(self.dtype)
        return self.model(tokens["input_ids"], tokens["attention_mask"], pixel_values)
