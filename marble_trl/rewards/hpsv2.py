"""HPSv2.1 (human preference score), on ``transformers``' ``CLIPModel``: the open_clip checkpoint is converted on
load, so ``open_clip`` is not needed; its preprocessing and text cleaning are reproduced exactly (docs/rewards.md).
The common behaviour of the weight-based rewards is :mod:`.clip_family`'s."""

from __future__ import annotations

import html
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .clip_family import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ModelReward, pooled_features

logger = logging.getLogger(__name__)


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
        offload: bool = False,
    ) -> None:
        super().__init__(device, dtype, batch_size, offload)
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
        image = pooled_features(self.model.get_image_features(pixel_values=pixel_values)).float()
        text = pooled_features(self.model.get_text_features(**self.tokenize(prompts))).float()
        return (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)
