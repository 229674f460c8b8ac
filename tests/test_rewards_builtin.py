"""Built-in weight-based and OCR rewards, loaded through their real code paths from tiny local models."""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import shutil
import string
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from marble_trl.rewards import RewardError, available_rewards, from_pil, get_reward, score_rewards, to_pil
from marble_trl.rewards.clip_family import AestheticMLP, ImageTransform, parse_dtype
from marble_trl.rewards.hpsv2 import hps_transform, open_clip_clean, open_clip_to_transformers
from marble_trl.rewards.ocr import levenshtein, ocr_similarity, quoted_text

transformers = pytest.importorskip("transformers")
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer  # noqa: E402

PROMPTS = ["a red cat on a mat", "two dogs, one blue", "a photo of the moon", "an astronaut riding a horse!"]


# ---------------------------------------------------------------------------------------------------------------------
# Tiny CLIP models built and saved locally (no Hub access)


def tiny_tokenizer() -> CLIPTokenizer:
    """A CLIP BPE tokenizer over printable ASCII plus two merges; unknown characters map to a dedicated <unk>."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "<unk>": 2}
    chars = [c for c in string.printable if not c.isspace() and not c.isupper()]
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    vocab["th"] = len(vocab)
    vocab["the</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[("t", "h"), ("th", "e</w>")], unk_token="<unk>")


def tiny_clip_config(vocab_size: int, act: str = "quick_gelu", image_size: int = 32) -> CLIPConfig:
    return CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            hidden_act=act,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=image_size,
            patch_size=8,
            hidden_act=act,
        ),
        projection_dim=16,
    )


def save_tiny_clip(path: Path, act: str = "quick_gelu", seed: int = 0) -> Path:
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = CLIPModel(tiny_clip_config(len(tok), act)).eval()
    with torch.no_grad():  # a non-default logit scale, so the PickScore formula is checked for real
        model.logit_scale.fill_(math.log(50.0))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    torch.manual_seed(1)
    # Smooth random images at a size the processor must resize (48x40 -> shortest edge 32, crop 32).
    return torch.nn.functional.interpolate(torch.rand(4, 3, 6, 5), size=(48, 40), mode="bilinear")


def pooled(out: Any) -> torch.Tensor:
    # CLIPModel.get_*_features: a tensor in transformers 4, an output object (pooler_output) in 5.
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def manual_embeddings(path: Path, prompts: list[str], images: torch.Tensor) -> tuple[CLIPModel, torch.Tensor]:
    """Cosine similarities computed with transformers' own processor on PIL images (the reference pipeline)."""
    model = CLIPModel.from_pretrained(path).eval()
    tok = CLIPTokenizer.from_pretrained(path)
    proc = CLIPImageProcessor.from_pretrained(path)
    with torch.no_grad():
        pix = proc(images=to_pil(images), return_tensors="pt")["pixel_values"]
        img = model.get_image_features(pixel_values=pix)
        txt = model.get_text_features(**tok(prompts, padding=True, return_tensors="pt"))
    img = img if isinstance(img, torch.Tensor) else img.pooler_output
    txt = txt if isinstance(txt, torch.Tensor) else txt.pooler_output
    cos = (torch.nn.functional.normalize(img, dim=-1) * torch.nn.functional.normalize(txt, dim=-1)).sum(-1)
    return model, cos


# ---------------------------------------------------------------------------------------------------------------------
# Registry


def test_builtins_are_registered() -> None:
    names = set(available_rewards())
    assert {"ocr", "clipscore", "pickscore", "aesthetic", "hpsv2", "imagereward", "http_reward"} <= names


def test_every_name_in_the_builtin_table_resolves_to_its_target() -> None:
    """The name table (no module registers itself): each target imports, is callable, and a plain reward carries
    its registered name (the metrics' key)."""
    from marble_trl.rewards import registry

    assert set(registry.BUILTIN_REWARDS) <= set(available_rewards())
    for name, (target, factory) in registry.BUILTIN_REWARDS.items():
        obj, is_factory = registry.registered(name)
        assert callable(obj) and is_factory == factory, name
        assert f"{obj.__module__}:{obj.__name__}" == target or factory, (name, obj)
        if not factory:
            assert get_reward(name) is obj and obj.__name__ == name
    with pytest.raises(ValueError, match="built-in reward's name"):
        registry.register_reward("brightness")(lambda prompts, images, **_: [0.0] * len(prompts))


@pytest.mark.parametrize("name", ["clipscore", "pickscore", "aesthetic", "hpsv2", "imagereward"])
def test_model_rewards_build_lazily_with_their_name(name: str) -> None:
    # A path that does not exist: nothing is read until the first call.
    fn = get_reward(name, model_name_or_path="/nonexistent/model", device="cpu", dtype="bfloat16", batch_size=3)
    assert fn.__name__ == name
    assert fn.dtype == torch.bfloat16 and fn.batch_size == 3 and fn.device == torch.device("cpu")


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        get_reward("clipscore", dtype="float8")
    with pytest.raises(ValueError, match="batch_size"):
        get_reward("pickscore", batch_size=0)
    assert parse_dtype("fp16") == torch.float16 and parse_dtype(torch.bfloat16) == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------------
# CLIPScore / PickScore


def test_clipscore_scores_batched_deterministic_and_faithful(tiny_clip: Path, images: torch.Tensor) -> None:
    fn = get_reward("clipscore", model_name_or_path=str(tiny_clip), batch_size=4)
    scores = fn(PROMPTS, images)
    assert len(scores) == 4 and all(isinstance(s, float) and math.isfinite(s) and -1 <= s <= 1 for s in scores)
    assert fn(PROMPTS, images) == scores  # deterministic
    one_by_one = get_reward("clipscore", model_name_or_path=str(tiny_clip), batch_size=1)(PROMPTS, images)
    np.testing.assert_allclose(one_by_one, scores, atol=1e-5)
    assert not any(p.requires_grad for p in fn.model.parameters()) and not fn.model.training
    # Against transformers' own PIL pipeline: tensor preprocessing differs by at most a uint8 rounding step.
    _, cos = manual_embeddings(tiny_clip, PROMPTS, images)
    np.testing.assert_allclose(scores, cos.tolist(), atol=1e-2)


def test_pickscore_formula(tiny_clip: Path, images: torch.Tensor) -> None:
    fn = get_reward("pickscore", model_name_or_path=str(tiny_clip), processor_name_or_path=str(tiny_clip))
    scores = fn(PROMPTS, images)
    model, cos = manual_embeddings(tiny_clip, PROMPTS, images)
    expected = model.logit_scale.exp().item() * cos / 26.0
    assert abs(model.logit_scale.exp().item() - 50.0) < 1e-3
    np.testing.assert_allclose(scores, expected.tolist(), atol=3e-2)
    # Exactly the formula on the reward's own embeddings.
    with torch.no_grad():
        img, txt = fn._embeddings(PROMPTS, images)
    np.testing.assert_allclose(scores, (50.0 * (img * txt).sum(-1) / 26.0).tolist(), rtol=1e-5, atol=1e-6)


def test_clip_reward_bfloat16_close_to_float32(tiny_clip: Path, images: torch.Tensor) -> None:
    fp32 = get_reward("clipscore", model_name_or_path=str(tiny_clip))(PROMPTS, images)
    bf16_fn = get_reward("clipscore", model_name_or_path=str(tiny_clip), dtype="bfloat16")
    bf16 = bf16_fn(PROMPTS, images)
    assert next(bf16_fn.model.parameters()).dtype == torch.bfloat16
    np.testing.assert_allclose(bf16, fp32, atol=5e-2)


def test_offloaded_reward_visits_its_device_only_while_scoring(
    tiny_clip: Path, images: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = get_reward("clipscore", model_name_or_path=str(tiny_clip))(PROMPTS, images)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fn = get_reward("clipscore", model_name_or_path=str(tiny_clip), offload=True, device=device, batch_size=2)
    moves, seen = [], []
    place, score = fn._place, fn._score
    monkeypatch.setattr(fn, "_place", lambda d: (moves.append(torch.device(d).type), place(d)))
    monkeypatch.setattr(fn, "_score", lambda p, x: (seen.append(next(fn.model.parameters()).device), score(p, x))[1])
    np.testing.assert_allclose(fn(PROMPTS, images), reference, atol=1e-5)
    assert moves == [fn.device.type, "cpu"]  # one visit per call, not per batch
    assert seen == [fn.device] * 2 and next(fn.model.parameters()).device.type == "cpu"
    assert "offload=True" in repr(fn)
    monkeypatch.setattr(fn, "_score", mock.Mock(side_effect=RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        fn(PROMPTS, images)
    assert moves[-1] == "cpu" and next(fn.model.parameters()).device.type == "cpu"  # put back on failure too


def test_image_transform_matches_clip_processor(images: torch.Tensor) -> None:
    proc = CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 20, "width": 20})
    ours = ImageTransform.from_image_processor(proc)(images)
    ref = proc(images=to_pil(images), return_tensors="pt")["pixel_values"]
    assert ours.shape == ref.shape == (4, 3, 20, 20)
    assert (ours - ref).abs().max() < 0.03  # one uint8 step is 1/255/std ~ 0.015


def test_wrong_image_shape_is_reported(tiny_clip: Path) -> None:
    fn = get_reward("clipscore", model_name_or_path=str(tiny_clip))
    with pytest.raises(RewardError, match="clipscore.*B, 3, H, W"):
        score_rewards([fn], ["a"], torch.rand(1, 32, 32))


# ---------------------------------------------------------------------------------------------------------------------
# Aesthetic

# The key names of sac+logos+ava1-l14-linearMSE.pth (Linear layers at indices 0, 2, 4, 6, 7 of `layers`).
AESTHETIC_KEYS = [f"layers.{i}.{k}" for i in (0, 2, 4, 6, 7) for k in ("weight", "bias")]


def test_aesthetic_loads_reference_keys_and_scores(tiny_clip: Path, images: torch.Tensor, tmp_path: Path) -> None:
    torch.manual_seed(3)
    mlp = AestheticMLP(16)  # the tiny CLIP's projection_dim
    assert sorted(mlp.state_dict()) == sorted(AESTHETIC_KEYS)
    mlp_path = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save({k: v.clone() for k, v in mlp.state_dict().items()}, mlp_path)

    fn = get_reward("aesthetic", model_name_or_path=str(tiny_clip), mlp_path=str(mlp_path), batch_size=3)
    scores = fn(PROMPTS, images)
    assert len(scores) == 4 and all(math.isfinite(s) for s in scores)
    assert not fn.mlp.training and not fn.vision.training

    model = CLIPModel.from_pretrained(tiny_clip).eval()
    proc = CLIPImageProcessor.from_pretrained(tiny_clip)
    with torch.no_grad():
        emb = model.get_image_features(pixel_values=proc(images=to_pil(images), return_tensors="pt")["pixel_values"])
        emb = emb if isinstance(emb, torch.Tensor) else emb.pooler_output
        expected = mlp.eval()(torch.nn.functional.normalize(emb, dim=-1)).squeeze(-1)
    np.testing.assert_allclose(scores, expected.tolist(), atol=2e-2)
    np.testing.assert_allclose(
        get_reward("aesthetic", model_name_or_path=str(tiny_clip), mlp_path=str(mlp_path), batch_size=1)(
            PROMPTS, images
        ),
        scores,
        atol=1e-5,
    )


# ---------------------------------------------------------------------------------------------------------------------
# HPSv2.1


def transformers_to_open_clip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Test-side inverse of the conversion: a transformers CLIPModel state dict in open_clip's (HPSv2's) layout."""
    out: dict[str, torch.Tensor] = {}
    for hf_root, oc_root in (
        ("vision_model.encoder.layers", "visual.transformer.resblocks"),
        ("text_model.encoder.layers", "transformer.resblocks"),
    ):
        n = len({k.split(".")[3] for k in sd if k.startswith(hf_root + ".")})
        for i in range(n):
            h, o = f"{hf_root}.{i}", f"{oc_root}.{i}"
            for kind in ("weight", "bias"):
                out[f"{o}.attn.in_proj_{kind}"] = torch.cat(
                    [sd[f"{h}.self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")], dim=0
                )
                out[f"{o}.attn.out_proj.{kind}"] = sd[f"{h}.self_attn.out_proj.{kind}"]
                out[f"{o}.ln_1.{kind}"] = sd[f"{h}.layer_norm1.{kind}"]
                out[f"{o}.ln_2.{kind}"] = sd[f"{h}.layer_norm2.{kind}"]
                out[f"{o}.mlp.c_fc.{kind}"] = sd[f"{h}.mlp.fc1.{kind}"]
                out[f"{o}.mlp.c_proj.{kind}"] = sd[f"{h}.mlp.fc2.{kind}"]
    out["visual.conv1.weight"] = sd["vision_model.embeddings.patch_embedding.weight"]
    out["visual.class_embedding"] = sd["vision_model.embeddings.class_embedding"]
    out["visual.positional_embedding"] = sd["vision_model.embeddings.position_embedding.weight"]
    for kind in ("weight", "bias"):
        out[f"visual.ln_pre.{kind}"] = sd[f"vision_model.pre_layrnorm.{kind}"]
        out[f"visual.ln_post.{kind}"] = sd[f"vision_model.post_layernorm.{kind}"]
        out[f"ln_final.{kind}"] = sd[f"text_model.final_layer_norm.{kind}"]
    out["visual.proj"] = sd["visual_projection.weight"].t().contiguous()
    out["text_projection"] = sd["text_projection.weight"].t().contiguous()
    out["token_embedding.weight"] = sd["text_model.embeddings.token_embedding.weight"]
    out["positional_embedding"] = sd["text_model.embeddings.position_embedding.weight"]
    out["logit_scale"] = sd["logit_scale"]
    return out


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(CLIP config/tokenizer folder, HPS-style checkpoint file) of one tiny GELU CLIP (ViT-H-14 uses GELU)."""
    clip_dir = save_tiny_clip(tmp_path_factory.mktemp("tiny_hps_clip"), act="gelu", seed=5)
    model = CLIPModel.from_pretrained(clip_dir)
    ckpt = clip_dir / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": transformers_to_open_clip(model.state_dict())}, ckpt)
    return clip_dir, ckpt


def test_open_clip_conversion_round_trips(tiny_hps: tuple[Path, Path]) -> None:
    clip_dir, ckpt = tiny_hps
    hf = CLIPModel.from_pretrained(clip_dir).state_dict()
    converted = open_clip_to_transformers(torch.load(ckpt, weights_only=True)["state_dict"])
    assert set(converted) == {k for k in hf if not k.endswith("position_ids")}
    for k, v in converted.items():
        assert torch.equal(v, hf[k]), k


def test_hpsv2_scores_like_the_model_it_converts(tiny_hps: tuple[Path, Path], images: torch.Tensor) -> None:
    clip_dir, ckpt = tiny_hps
    fn = get_reward("hpsv2", model_name_or_path=str(ckpt), clip_name_or_path=str(clip_dir), batch_size=3)
    scores = fn(PROMPTS, images)
    assert len(scores) == 4 and all(math.isfinite(s) and -1 <= s <= 1 for s in scores)
    # A folder holding the checkpoint under `filename` loads the same weights.
    by_dir = get_reward("hpsv2", model_name_or_path=str(clip_dir), clip_name_or_path=str(clip_dir), batch_size=1)
    np.testing.assert_allclose(by_dir(PROMPTS, images), scores, atol=1e-5)

    model = CLIPModel.from_pretrained(clip_dir).eval()
    tok = CLIPTokenizer.from_pretrained(clip_dir)
    with torch.no_grad():
        img = model.get_image_features(pixel_values=hps_transform(images, 32))
        txt = model.get_text_features(**tok(PROMPTS, padding=True, return_tensors="pt"))
    img = img if isinstance(img, torch.Tensor) else img.pooler_output
    txt = txt if isinstance(txt, torch.Tensor) else txt.pooler_output
    expected = (torch.nn.functional.normalize(img, dim=-1) * torch.nn.functional.normalize(txt, dim=-1)).sum(-1)
    np.testing.assert_allclose(scores, expected.tolist(), atol=1e-5)


def test_hps_transform_resizes_longest_side_and_pads() -> None:
    x = torch.ones(1, 3, 20, 40)
    out = hps_transform(x, 32)
    assert out.shape == (1, 3, 32, 32)
    black = (0 - torch.tensor([0.48145466, 0.4578275, 0.40821073])) / torch.tensor(
        [0.26862954, 0.26130258, 0.27577711]
    )
    torch.testing.assert_close(out[0, :, 0, 0], black)  # padded rows (16 image rows centred in 32)
    torch.testing.assert_close(
        out[0, :, 16, 16],
        (1 - torch.tensor([0.48145466, 0.4578275, 0.40821073])) / torch.tensor([0.26862954, 0.26130258, 0.27577711]),
    )


def test_hps_transform_keeps_the_bicubic_overshoot() -> None:
    # HPSv2's preprocess_val resizes the float tensor after ToTensor(): torchvision's tensor resize, which is
    # F.interpolate(bicubic, antialias=True) with no clamping (checked by hand against torchvision 0.28, see
    # docs/rewards.md). A sharp square overshoots past 0 and 1; those values reach the model.
    x = torch.zeros(1, 3, 40, 60)
    x[..., 10:30, 20:40] = 1.0
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    out = hps_transform(x, 30) * std + mean
    ref = torch.nn.functional.interpolate(x, size=(20, 30), mode="bicubic", align_corners=False, antialias=True)
    assert ref.min() < -0.01 and ref.max() > 1.01
    torch.testing.assert_close(out[..., 5:25, :], ref)
    torch.testing.assert_close(out[..., :5, :], torch.zeros(1, 3, 5, 30), atol=1e-6, rtol=0)  # zero padding


def test_hpsv2_checkpoint_that_does_not_fit_is_reported(tiny_hps: tuple[Path, Path], tmp_path: Path) -> None:
    clip_dir, ckpt = tiny_hps
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    del state["ln_final.weight"]
    bad = tmp_path / "bad.pt"
    torch.save({"state_dict": state}, bad)
    fn = get_reward("hpsv2", model_name_or_path=str(bad), clip_name_or_path=str(clip_dir))
    with pytest.raises(RuntimeError, match="hpsv2.*bad.pt.*ln_final"):
        fn(PROMPTS[:1], torch.rand(1, 3, 32, 32))


# ---------------------------------------------------------------------------------------------------------------------
# HPSv2.1 against HPSv2's own open_clip code, vendored byte-for-byte in tests/_vendor/hpsv2_open_clip (its README says
# why it is vendored and not installed: hpsv2 and open-clip-torch need a torchvision that cannot import here)

HPS_VENDOR = Path(__file__).parent / "_vendor" / "hpsv2_open_clip"
# sha256 (urlsafe base64, as in a wheel's RECORD) of hpsv2-1.2.0-py3-none-any.whl's hpsv2/src/open_clip/<file>.
HPS_VENDOR_RECORD = {
    "model.py": "gcUU52xE-pln48PILYtVjRyMgDG_d-UXDg1LGsU-nEY",
    "transformer.py": "Zrf2rl2kYWLTAru0kKdenQxMyltA0pgtwEkXnWsNKdw",
    "utils.py": "bSlOccwUoBrRl3Hb8ifVEYVNd06o3bpNA9W4X-uQUhM",
    "tokenizer.py": "nbAsWS_QWGQbUn9-tMTeVi5coNvWEg6Y9Emnu-8lHmw",
    "constants.py": "PKjrqkcdpJK_MQmnTsZ2oxhxIHn9AlI-y2ap87BnR1Q",
}
# A small BPE merges file in the format of open_clip's bpe_simple_vocab_16e6.txt.gz (a header line, then one merge per
# line, rank order). Vocabulary: 256 byte symbols, the same 256 with "</w>", one token per merge, then
# <start_of_text> and <end_of_text>: the end-of-text token is the highest id, as in the real 49408-token vocabulary.
# fmt: off
HPS_MERGES = ["t h", "th e</w>", "c a", "ca t</w>", "o n</w>", "r e", "d o", "do g", "a n</w>", "h o", "ho r", "s e</w>",
              "hor se</w>"]
# fmt: on
# ViT-H-14.json (open_clip's and hpsv2's): {"embed_dim": 1024, "vision_cfg": {"image_size": 224, "layers": 32,
# "width": 1280, "head_width": 80, "patch_size": 14}, "text_cfg": {"context_length": 77, "vocab_size": 49408,
# "width": 1024, "heads": 16, "layers": 24}}. The same keys (so the same classes: class-token ViT with ln_pre and
# ln_post, causal text transformer pooled at the end-of-text token, GELU, bias-free projections) at tiny sizes; the
# 224 px input keeps HPSv2's preprocessing real. vocab_size is filled in from the tokenizer.
TINY_VIT_H_14 = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 224, "layers": 2, "width": 40, "head_width": 8, "patch_size": 56},
    "text_cfg": {"context_length": 77, "vocab_size": None, "width": 32, "heads": 4, "layers": 2},
}
HPS_PROMPTS = [
    "a red cat on the mat",
    "two dogs!! one horse!",  # "!" is the pad token of laion's transformers tokenizers
    "A sign that says “OPEN” &amp;amp; a ﬁsh  in\tＦＵＬＬ width",  # changed by open_clip's ftfy/html/whitespace clean
    "an astronaut riding a horse " * 12,  # over 77 tokens: truncated, end-of-text token kept last
]


def load_hpsv2_open_clip(tmp: Path) -> types.SimpleNamespace:
    """Import the vendored files as the private package ``_hpsv2_open_clip`` without hpsv2's ``__init__``.

    Test-only stand-ins, present only while importing: ``torchvision.ops.misc.FrozenBatchNorm2d`` (utils.py imports
    it to freeze ResNet towers) and the HF-text / ResNet / timm tower modules model.py imports (not used by ViT CLIPs).
    tokenizer.py runs with ``__file__`` in ``tmp``, so its module-level ``SimpleTokenizer()`` reads HPS_MERGES.
    """
    try:
        import ftfy  # noqa: F401  (tokenizer.py imports it)
    except ImportError as err:
        raise ImportError('ftfy is missing: it is in the dev extra, pip install -e ".[dev]"') from err
    name = "_hpsv2_open_clip"
    with gzip.open(tmp / "bpe_simple_vocab_16e6.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(["#version: 0.2", *HPS_MERGES]))  # no final newline: open_clip would read an empty merge

    class FrozenBatchNorm2d(torch.nn.Module):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise NotImplementedError("test stand-in for torchvision's FrozenBatchNorm2d")

    torchvision = types.ModuleType("torchvision")
    torchvision.ops = types.ModuleType("torchvision.ops")
    torchvision.ops.misc = types.ModuleType("torchvision.ops.misc")
    torchvision.ops.misc.FrozenBatchNorm2d = FrozenBatchNorm2d
    shims = {
        "torchvision": torchvision,
        "torchvision.ops": torchvision.ops,
        "torchvision.ops.misc": torchvision.ops.misc,
    }
    package = types.ModuleType(name)
    package.__path__ = [str(HPS_VENDOR)]
    towers = {"hf_model": "HFTextEncoder", "modified_resnet": "ModifiedResNet", "timm_model": "TimmModel"}
    saved = {k: sys.modules.pop(k) for k in shims if k in sys.modules}
    try:
        sys.modules.update(shims)
        sys.modules[name] = package
        for module, attr in towers.items():
            sys.modules[f"{name}.{module}"] = types.ModuleType(f"{name}.{module}")
            setattr(sys.modules[f"{name}.{module}"], attr, None)
        model = importlib.import_module(f"{name}.model")
        constants = importlib.import_module(f"{name}.constants")
        spec = importlib.util.spec_from_file_location(f"{name}.tokenizer", HPS_VENDOR / "tokenizer.py")
        tokenizer = importlib.util.module_from_spec(spec)
        tokenizer.__file__ = str(tmp / "tokenizer.py")
        sys.modules[spec.name] = tokenizer
        with mock.patch.dict(os.environ):  # tokenizer.py sets TOKENIZERS_PARALLELISM
            spec.loader.exec_module(tokenizer)
    finally:
        for k in shims:
            sys.modules.pop(k, None)
        sys.modules.update(saved)
    return types.SimpleNamespace(model=model, tokenizer=tokenizer, constants=constants)


def test_vendored_open_clip_is_hpsv2s_release() -> None:
    for file, digest in HPS_VENDOR_RECORD.items():
        sha = hashlib.sha256((HPS_VENDOR / file).read_bytes()).digest()
        assert base64.urlsafe_b64encode(sha).rstrip(b"=").decode() == digest, file


@pytest.fixture(scope="module")
def hps_open_clip(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    return load_hpsv2_open_clip(tmp_path_factory.mktemp("hpsv2_open_clip"))


def save_hps_clip_folder(path: Path, st: Any, eos_token_id: int) -> None:
    """The ``clip_name_or_path`` folder: a transformers CLIP config matching TINY_VIT_H_14 and a transformers tokenizer
    with open_clip's vocabulary and merges, special tokens named as in laion's ViT-H-14 repo ("!" as padding)."""
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    CLIPTokenizer(
        vocab={names.get(k, k): v for k, v in st.encoder.items()},
        merges=sorted(st.bpe_ranks, key=st.bpe_ranks.get),
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="!",
    ).save_pretrained(path)
    v, t = TINY_VIT_H_14["vision_cfg"], TINY_VIT_H_14["text_cfg"]
    CLIPConfig(
        text_config=dict(
            vocab_size=st.vocab_size,
            hidden_size=t["width"],
            intermediate_size=4 * t["width"],  # open_clip's default mlp_ratio 4
            num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"],
            max_position_embeddings=t["context_length"],
            hidden_act="gelu",  # nn.GELU: ViT-H-14 is not a quick_gelu model
            bos_token_id=st.encoder["<start_of_text>"],
            eos_token_id=eos_token_id,
            pad_token_id=0,
        ),
        vision_config=dict(
            hidden_size=v["width"],
            intermediate_size=4 * v["width"],
            num_hidden_layers=v["layers"],
            num_attention_heads=v["width"] // v["head_width"],
            image_size=v["image_size"],
            patch_size=v["patch_size"],
            hidden_act="gelu",
        ),
        projection_dim=TINY_VIT_H_14["embed_dim"],
    ).save_pretrained(path)


@pytest.fixture(scope="module", params=["eos_id", "legacy_eos_2"])
def hps_pair(request: pytest.FixtureRequest, hps_open_clip: types.SimpleNamespace, tmp_path_factory) -> tuple:
    """(hpsv2's open_clip CLIP, the hpsv2 reward loading its checkpoint) with the same random weights.

    Both text-pooling conventions of transformers CLIP configs: eos_token_id = the tokenizer's end-of-text id (pool at
    its first occurrence), and the legacy eos_token_id = 2 (pool at argmax(token id), open_clip's rule).
    """
    st = hps_open_clip.tokenizer._tokenizer
    cfg = copy.deepcopy(TINY_VIT_H_14)
    cfg["text_cfg"]["vocab_size"] = st.vocab_size
    torch.manual_seed(0)
    # As hpsv2's create_model('ViT-H-14', precision='amp', output_dict=True) builds it: CLIP(**model_cfg, cast_dtype=None)
    oc = hps_open_clip.model.CLIP(**cfg, output_dict=True)
    assert type(oc.visual).__name__ == "VisionTransformer"
    with torch.no_grad():  # open_clip's init leaves biases at 0 and LayerNorms at 1/0: move every weight off it
        for p in oc.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    oc.eval()
    folder = tmp_path_factory.mktemp(f"hps_{request.param}")
    # As HPS_v2.1_compressed.pt is stored (hpsv2.score: model.load_state_dict(checkpoint['state_dict'])).
    torch.save({"state_dict": oc.state_dict()}, folder / "HPS_v2.1_compressed.pt")
    save_hps_clip_folder(folder, st, st.encoder["<end_of_text>"] if request.param == "eos_id" else 2)
    fn = get_reward("hpsv2", model_name_or_path=str(folder), clip_name_or_path=str(folder), batch_size=3)
    fn.load()
    return oc, fn


def hps_images(n: int, h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.interpolate(torch.rand(n, 3, 7, 6, generator=g), size=(h, w), mode="bicubic").clamp(
        0, 1
    )


# Tolerances: both sides run float32 on CPU on identical weights and inputs; they differ only in op order (q/k/v split
# vs fused in_proj, SDPA vs MultiheadAttention), i.e. a few float32 ulps per op. Features are O(1) (max |x| ~ 1-3):
# 1e-5 relative to the largest feature is ~100x float32's epsilon and far below any conversion error (a transposed
# or misassigned weight changes features by O(1)). Scores are cosines in [-1, 1]: atol 1e-6.
def assert_features_close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-5 * ref.abs().max().item(), diff
    return diff


def test_hpsv2_features_match_hpsv2_open_clip(hps_pair: tuple, hps_open_clip: types.SimpleNamespace) -> None:
    oc, fn = hps_pair
    images = hps_images(len(HPS_PROMPTS), 224, 224, seed=1)
    pixels = hps_transform(images, 224)
    tokens = fn.tokenize(HPS_PROMPTS)
    ref_tokens = hps_open_clip.tokenizer.tokenize(HPS_PROMPTS)  # [n, 77], padded with 0 (also the id of "!")
    for ids, mask, ref in zip(tokens["input_ids"], tokens["attention_mask"], ref_tokens):
        assert ids[mask.bool()].tolist() == ref[: int(ref.argmax()) + 1].tolist()  # up to <end_of_text>, the top id
    with torch.no_grad():
        img = pooled(fn.model.get_image_features(pixel_values=pixels))
        txt = pooled(fn.model.get_text_features(**tokens))
        ref_img, ref_txt = oc.encode_image(pixels), oc.encode_text(ref_tokens)
    assert_features_close(img, ref_img)
    assert_features_close(txt, ref_txt)


def test_hpsv2_score_matches_hpsv2_open_clip(hps_pair: tuple, hps_open_clip: types.SimpleNamespace) -> None:
    """hpsv2.score's computation: diag(image_features @ text_features.T) of model(preprocess_val(image), tokenize)."""
    oc, fn = hps_pair
    # 224x224: preprocess_val's ResizeMaxSize does nothing, so it is ToTensor() and Normalize(OPENAI_DATASET_MEAN/STD)
    # (hpsv2's constants); ToTensor's uint8 step is ours to skip: the reward reads the float image itself.
    images = hps_images(len(HPS_PROMPTS), 224, 224, seed=2)
    mean = torch.tensor(hps_open_clip.constants.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(hps_open_clip.constants.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        out = oc((images - mean) / std, hps_open_clip.tokenizer.tokenize(HPS_PROMPTS))
        expected = torch.diagonal(out["image_features"] @ out["text_features"].T)
    np.testing.assert_allclose(fn(HPS_PROMPTS, images), expected.tolist(), rtol=0, atol=1e-6)


def test_open_clip_clean_is_open_clips(hps_open_clip: types.SimpleNamespace) -> None:
    from ftfy import fix_text

    tok = hps_open_clip.tokenizer
    for text in [*HPS_PROMPTS, "  Â© mojibake\u2028line\x1cgroup  ", "&lt;b&gt; ‘single’ \u00a0nbsp"]:
        assert open_clip_clean(text, fix_text) == tok.whitespace_clean(tok.basic_clean(text)), text
    assert open_clip_clean(" a  “b” &amp; c ", None) == "a “b” & c"  # without ftfy: html and whitespace only


def test_hpsv2_without_ftfy_warns(tiny_hps: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    clip_dir, ckpt = tiny_hps
    monkeypatch.setitem(sys.modules, "ftfy", None)
    fn = get_reward("hpsv2", model_name_or_path=str(ckpt), clip_name_or_path=str(clip_dir))
    with caplog.at_level(logging.WARNING, logger="marble_trl.rewards.hpsv2"):
        fn.load()
    assert "ftfy is not installed" in caplog.text and fn._fix_text is None


def test_hpsv2_rejects_eos_id_that_is_not_the_tokenizers(tiny_hps: tuple[Path, Path], tmp_path: Path) -> None:
    clip_dir, ckpt = tiny_hps
    shutil.copytree(clip_dir, tmp_path / "clip")
    config = json.loads((tmp_path / "clip" / "config.json").read_text())
    config["text_config"]["eos_token_id"] = 5  # neither 2 (argmax pooling) nor the tokenizer's <|endoftext|> (1)
    (tmp_path / "clip" / "config.json").write_text(json.dumps(config))
    fn = get_reward("hpsv2", model_name_or_path=str(ckpt), clip_name_or_path=str(tmp_path / "clip"))
    with pytest.raises(RuntimeError, match="eos_token_id=5.*end-of-text token is 1"):
        fn.load()


# ImageReward: tests/test_rewards_imagereward.py


# ---------------------------------------------------------------------------------------------------------------------
# OCR


def test_quoted_text_and_similarity() -> None:
    assert quoted_text('a sign that says "Hello World" at night') == "Hello World"
    assert quoted_text('"first" and "second"') == "first"
    assert quoted_text("no quotes here") is None
    assert quoted_text('an unclosed "quote') is None
    assert quoted_text('empty "" quotes') is None
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert ocr_similarity("HELLO WORLD", "hello world") == 1.0
    assert ocr_similarity("xx hello world yy", "Hello World") == 1.0  # target is a substring: distance 0
    assert ocr_similarity("hellp", "hello") == pytest.approx(0.8)
    assert ocr_similarity("", "hello") == 0.0
    assert ocr_similarity("a completely different long sentence", "hi") == 0.0  # clipped at 0


def render_text(text: str, size: tuple[int, int] = (320, 128)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    try:
        font = ImageFont.truetype("DejaVuSans-Bold.ttf", 30)
    except OSError:
        font = ImageFont.load_default(size=30)
    ImageDraw.Draw(image).text((12, 44), text, fill="black", font=font)
    return image


def test_ocr_reads_rendered_text() -> None:
    pytest.importorskip("rapidocr")
    pytest.importorskip("onnxruntime")
    fn = get_reward("ocr")
    assert fn.__name__ == "ocr"
    images = from_pil([render_text("HELLO MARBLE"), Image.new("RGB", (320, 128), "white"), render_text("HELLO")])
    prompts = ['a poster that says "Hello Marble"', 'a sign reading "Hello Marble"', "a plain sign, no text"]
    scores = fn(prompts, images)
    assert scores[0] >= 0.9
    assert scores[1] <= 0.1
    assert scores[2] is None
    out = score_rewards([fn], prompts, images)
    assert math.isnan(out[0, 2].item()) and out[0, 0].item() >= 0.9


def test_ocr_without_rapidocr_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rapidocr", None)
    fn = get_reward("ocr")
    with pytest.raises(ImportError, match=r"marble-trl\[ocr\]"):
        fn(['say "hi"'], torch.ones(1, 3, 32, 32))
    assert fn(["no quotes"], torch.ones(1, 3, 32, 32)) == [None]  # nothing to read: no engine needed


def test_ocr_rejects_unknown_device() -> None:
    with pytest.raises(ValueError, match="device"):
        get_reward("ocr", device="mps")
