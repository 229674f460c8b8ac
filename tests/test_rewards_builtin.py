"""Built-in weight-based and OCR rewards, loaded through their real code paths from tiny local models."""

from __future__ import annotations

import json
import math
import string
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from marble_trl.rewards import RewardError, available_rewards, from_pil, get_reward, score_rewards, to_pil
from marble_trl.rewards.clip_family import (
    AestheticMLP,
    ImageTransform,
    hps_transform,
    open_clip_to_transformers,
    parse_dtype,
)
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


def test_hpsv2_checkpoint_that_does_not_fit_is_reported(tiny_hps: tuple[Path, Path], tmp_path: Path) -> None:
    clip_dir, ckpt = tiny_hps
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    del state["ln_final.weight"]
    bad = tmp_path / "bad.pt"
    torch.save({"state_dict": state}, bad)
    fn = get_reward("hpsv2", model_name_or_path=str(bad), clip_name_or_path=str(clip_dir))
    with pytest.raises(RuntimeError, match="hpsv2.*bad.pt.*ln_final"):
        fn(PROMPTS[:1], torch.rand(1, 3, 32, 32))


def test_hpsv2_matches_open_clip(tmp_path: Path, images: torch.Tensor) -> None:
    """The conversion against open_clip itself (runs only where open_clip and a working torchvision import)."""
    try:
        import open_clip
        from open_clip.tokenizer import SimpleTokenizer
    except Exception as err:  # ImportError, or torchvision built for another torch
        pytest.skip(f"open_clip unavailable: {err}")
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 28, "layers": 2, "width": 32, "head_width": 8, "patch_size": 7},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2},
    }
    (tmp_path / "tiny-hps-test.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path)
    torch.manual_seed(0)
    oc = open_clip.create_model("tiny-hps-test", pretrained=None).eval()
    with torch.no_grad():
        for p in oc.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    torch.save({"state_dict": oc.state_dict()}, tmp_path / "HPS_v2.1_compressed.pt")
    CLIPConfig(
        text_config=dict(
            vocab_size=49408,
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            hidden_act="gelu",
            eos_token_id=49407,
            bos_token_id=49406,
            pad_token_id=0,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=28,
            patch_size=7,
            hidden_act="gelu",
        ),
        projection_dim=16,
    ).save_pretrained(tmp_path)
    st = SimpleTokenizer()
    CLIPTokenizer(
        vocab=st.encoder,
        merges=sorted(st.bpe_ranks, key=st.bpe_ranks.get),
        pad_token="!",
        bos_token="<start_of_text>",
        eos_token="<end_of_text>",
        unk_token="<end_of_text>",
    ).save_pretrained(tmp_path)
    scores = get_reward("hpsv2", model_name_or_path=str(tmp_path), clip_name_or_path=str(tmp_path))(PROMPTS, images)
    with torch.no_grad():
        img = oc.encode_image(hps_transform(images, 28), normalize=True)
        txt = oc.encode_text(open_clip.get_tokenizer("tiny-hps-test")(PROMPTS), normalize=True)
    np.testing.assert_allclose(scores, (img * txt).sum(-1).tolist(), atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# ImageReward: only the missing-dependency path can run here (see docs/rewards.md)


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
