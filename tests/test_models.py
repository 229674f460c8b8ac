"""The tiny offline SD3 pipeline: determinism, save/load round trip (plain diffusers too), and the loader's errors."""

from __future__ import annotations

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from marble_trl.models import build_tiny_sd3_pipeline, load_sd3_pipeline, save_tiny_sd3_pipeline, tiny_seed_of

COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")
CALL = dict(num_inference_steps=2, height=32, width=32, max_sequence_length=8, output_type="pt", guidance_scale=1.0)


def weights(pipe) -> dict[str, torch.Tensor]:
    return {f"{c}.{k}": v for c in COMPONENTS for k, v in getattr(pipe, c).state_dict().items()}


def generate(pipe, prompts=("a red apple", 'a sign that says "hi"'), seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return pipe(list(prompts), generator=gen, **CALL).images


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, tiny_pipeline):
    path = tmp_path_factory.mktemp("tiny_sd3")
    tiny_pipeline.save_pretrained(path)
    return path


# ---------------------------------------------------------------- determinism


def test_same_seed_gives_identical_weights(tiny_pipeline):
    a, b = weights(tiny_pipeline), weights(build_tiny_sd3_pipeline(seed=0))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_different_seed_gives_different_weights(tiny_pipeline):
    a, b = weights(tiny_pipeline), weights(build_tiny_sd3_pipeline(seed=1))
    assert a.keys() == b.keys()
    for component in COMPONENTS:
        differing = [n for n in a if n.startswith(component + ".") and not torch.equal(a[n], b[n])]
        assert differing, component


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_sd3_pipeline(seed=5)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_tiny_pipeline_shape_and_images(tiny_pipeline):
    assert tiny_pipeline.text_encoder_3 is None and tiny_pipeline.tokenizer_3 is None
    images = generate(tiny_pipeline)
    assert images.shape == (2, 3, 32, 32)
    assert torch.isfinite(images).all()
    assert images.min() >= 0 and images.max() <= 1
    torch.testing.assert_close(generate(tiny_pipeline), images, rtol=0, atol=0)
    assert not torch.equal(generate(tiny_pipeline, seed=1), images)


# ---------------------------------------------------------------- save / load round trip


def test_save_and_load_give_identical_images(tiny_pipeline, saved_tiny):
    assert (saved_tiny / "model_index.json").is_file()
    plain = StableDiffusion3Pipeline.from_pretrained(saved_tiny, text_encoder_3=None, tokenizer_3=None)
    loaded = load_sd3_pipeline(saved_tiny)
    assert isinstance(loaded, StableDiffusion3Pipeline)
    assert loaded.text_encoder_3 is None and loaded.tokenizer_3 is None
    images = generate(loaded)
    torch.testing.assert_close(generate(plain), images, rtol=0, atol=0)
    # the freshly built pipeline (in eval mode, like a loaded one): same weights, same images
    torch.testing.assert_close(generate(tiny_pipeline), images, rtol=0, atol=0)
    for name, value in weights(tiny_pipeline).items():
        assert torch.equal(weights(loaded)[name], value), name


def test_load_sd3_pipeline_accepts_str_and_path(saved_tiny):
    a, b = weights(load_sd3_pipeline(str(saved_tiny))), weights(load_sd3_pipeline(saved_tiny))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_built_pipeline_is_in_eval_mode_like_a_loaded_one():
    pipe = build_tiny_sd3_pipeline(seed=0)
    assert not any(getattr(pipe, c).training for c in COMPONENTS)


def test_save_tiny_sd3_pipeline_round_trip(tmp_path, tiny_pipeline):
    path = save_tiny_sd3_pipeline(tmp_path / "tiny", seed=0)
    assert path == tmp_path / "tiny"
    a, b = weights(load_sd3_pipeline(path)), weights(tiny_pipeline)
    for name in b:
        assert torch.equal(a[name], b[name]), name


def test_saved_tiny_folder_loads_with_plain_diffusers(tmp_path, tiny_pipeline):
    """`StableDiffusion3Pipeline.from_pretrained(folder)`, no extra arguments: the saved folder has the standard SD3
    layout (a placeholder T5 with exactly zero output), and it generates the built pipeline's images."""
    path = save_tiny_sd3_pipeline(tmp_path / "tiny", seed=0)
    plain = StableDiffusion3Pipeline.from_pretrained(path)
    assert plain.text_encoder_3 is not None and plain.tokenizer_3 is not None
    images = generate(plain)
    assert (images - generate(build_tiny_sd3_pipeline(seed=1))).abs().max() > 1e-3  # not vacuous
    torch.testing.assert_close(images, generate(tiny_pipeline), rtol=0, atol=0)
    torch.testing.assert_close(generate(load_sd3_pipeline(path)), images, rtol=0, atol=0)
    long_prompt = ["a very long prompt with many more words than the eight tokens of max_sequence_length"]
    torch.testing.assert_close(generate(plain, long_prompt), generate(tiny_pipeline, long_prompt), rtol=0, atol=0)


def test_tiny_pipeline_records_its_name_and_seed(tmp_path, tiny_pipeline):
    """What a run records as its base model, when the CLI passes the built pipeline object to the trainer."""
    from marble_trl.persistence.checkpoint import base_model_name

    pipe = build_tiny_sd3_pipeline(seed=3)
    assert pipe.name_or_path == "tiny" and tiny_seed_of(pipe) == 3 and tiny_seed_of(tiny_pipeline) == 0

    # the trainer's model_name_or_path is None for a pipeline object: the pipeline's name is used
    assert base_model_name(pipe, None) == "tiny" and base_model_name(pipe, "org/model") == "org/model"
    loaded = load_sd3_pipeline(save_tiny_sd3_pipeline(tmp_path / "tiny", seed=3))
    assert loaded.name_or_path == str(tmp_path / "tiny") and tiny_seed_of(loaded) is None  # a folder, not "tiny"


def test_load_tiny_by_name(tiny_pipeline):
    a, b = weights(load_sd3_pipeline("tiny")), weights(tiny_pipeline)
    for name in b:
        assert torch.equal(a[name], b[name]), name
    other = weights(load_sd3_pipeline("tiny", tiny_seed=3))
    assert not all(torch.equal(other[n], b[n]) for n in b)


def test_load_with_dtype(saved_tiny):
    pipe = load_sd3_pipeline(saved_tiny, torch_dtype=torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("relative", [False, True])
def test_missing_local_path_raises_file_not_found(tmp_path, monkeypatch, relative):
    monkeypatch.chdir(tmp_path)
    missing = "./no_such_model" if relative else str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError) as info:
        load_sd3_pipeline(missing)
    message = str(info.value)
    assert "no_such_model" in message and "not an existing folder" in message
    assert "tiny" in message  # points at the offline alternative


def test_nested_missing_path_is_local_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not an existing folder"):
        load_sd3_pipeline("models/sd3/checkpoint")


def test_folder_without_model_index_raises(tmp_path):
    folder = tmp_path / "not_a_pipeline"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_sd3_pipeline(folder)


def test_family_adapter_of_an_sd3_pipeline(tiny_pipeline):
    """The trainer's seam: adapter_for finds the SD3 adapter, which satisfies the protocol and computes what the SD3
    functions compute; an unsupported pipeline is an error that names the supported ones."""
    from marble_trl.models import FlowModelAdapter, SD3Adapter, adapter_for, encode_prompts, predict_velocity

    adapter = adapter_for(tiny_pipeline)
    assert isinstance(adapter, SD3Adapter) and isinstance(adapter, FlowModelAdapter)
    assert adapter.family == "sd3" and adapter.transformer is tiny_pipeline.transformer
    assert adapter.latent_factor == tiny_pipeline.vae_scale_factor * tiny_pipeline.transformer.config.patch_size
    cond = adapter.encode(["a red apple", "a red apple", "a cat"], 8, torch.device("cpu"))
    ref = encode_prompts(tiny_pipeline, ["a red apple", "a red apple", "a cat"], 8, torch.device("cpu"))
    assert torch.equal(cond.prompt_embeds, ref.prompt_embeds) and torch.equal(cond.index([2]).pooled, ref.pooled[2:])
    x = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        got = adapter.predict(tiny_pipeline.transformer, x, sigma, cond)
        want = predict_velocity(tiny_pipeline.transformer, x, sigma, ref.prompt_embeds, ref.pooled)
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="not a supported pipeline.*StableDiffusion3Pipeline"):
        adapter_for(object())
