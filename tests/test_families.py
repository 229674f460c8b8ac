"""Every model family behind the seam, on its offline tiny model: loading and dispatch, the rollout reproduced by the
trainer's own velocity and sigma grid, the velocity convention, per-reward gradients against explicit autograd in
float64, Prop. 1 through the trainer, training from the CLI, and the exported LoRA loading with the family's pipeline.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from tiny import brightness, contrast, explicit_per_reward_gradients, tiny_args

from marble_trl import MarbleDiffusionNFTTrainer
from marble_trl.balance import make_gradient_engine
from marble_trl.cli import main
from marble_trl.data.prompts import load_prompt_dataset
from marble_trl.models import FAMILIES, adapter_for, family_of, load_model
from marble_trl.policy.nft import add_noise, nft_loss_terms
from marble_trl.publish.export import generate_images
from marble_trl.rewards.images import to_pil
from marble_trl.rollout.solvers import make_scheduler, training_sigmas

pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")

TINY_NAMES = [f.tiny_name for f in FAMILIES]
RESOLUTION = 16
PROMPTS = ["a red apple", "a blue boat on a lake"]
CPU = torch.device("cpu")


def _guidance(adapter) -> float:
    return 3.5 if adapter.guidance == "embedded" else 2.0  # CFG families: a real CFG rollout with the negative prompt


def _sources(adapter, n: int) -> dict:
    """An editing family's source images for ``n`` prompts (two distinct images, in turn), ``{}`` otherwise."""
    if not adapter.editing:
        return {}
    side = adapter.source_resolution
    images = torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(11))
    images = (images * 255).round() / 255  # uint8-exact: the trainer's loader rounds a tensor's pixels to uint8
    return {"source_images": images[torch.arange(n) % 2]}


def _encode(adapter, prompts: list[str], max_len: int, guidance: float = 1.0):
    return adapter.encode(prompts, max_len, CPU, guidance, **_sources(adapter, len(prompts)))


def _dataset(adapter_or_name):
    """The prompts a family trains on here: the bundled prompts, an editing family's the ShapesBench edits."""
    from marble_trl.data.sources import load_source

    editing = family_of(adapter_or_name).editing if isinstance(adapter_or_name, str) else adapter_or_name.editing
    return load_source("shapes_edit") if editing else load_prompt_dataset()


def _initial_noise(adapter, n: int, seed: int) -> torch.Tensor:
    """The pipeline's first draw from ``seed``: noise of the adapter's latent shape (drawn unpacked)."""
    x0 = adapter.sample(make_scheduler("euler", adapter.pipeline.scheduler), _encode(adapter, PROMPTS[:1] * n, 8),
                        1, RESOLUTION, torch.Generator().manual_seed(seed))  # fmt: skip
    return torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed), dtype=x0.dtype)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_offline_name_folder_and_pipeline_pick_the_family(name, tmp_path):
    import importlib.util

    if name == "tiny-qwen-image-edit" and importlib.util.find_spec("torchvision") is None:
        pytest.skip("transformers saves and loads the Qwen2-VL processor with its video processor: torchvision")
    adapter = load_model(name)
    assert adapter.tiny_name == name and adapter_for(adapter.pipeline).family == adapter.family
    folder = tmp_path / "model"
    if adapter.family == "sd3":
        from marble_trl.models import save_tiny_sd3_pipeline

        save_tiny_sd3_pipeline(folder)
    else:
        adapter.pipeline.save_pretrained(folder)
    assert family_of(folder) is type(adapter)  # from model_index.json's _class_name
    loaded = load_model(folder)
    for (k, a), (_, b) in zip(adapter.transformer.state_dict().items(), loaded.transformer.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)


def test_unsupported_pipeline_lists_the_supported_ones(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError, match="StableDiffusionXLPipeline is not a supported pipeline.*FluxPipeline"):
        load_model(tmp_path)
    with pytest.raises(
        TypeError,
        match="supported: StableDiffusion3Pipeline, FluxPipeline, WanPipeline, QwenImagePipeline, ZImagePipeline",
    ):
        adapter_for(object())


@pytest.mark.parametrize("name", TINY_NAMES)
def test_rollout_is_euler_on_the_trainers_velocity_and_grid(name):
    """The family pipeline's own ``__call__`` (Euler, ``output_type="latent"``) equals an Euler loop over the
    trainer's training grid with the adapter's ``predict``, guidance as the family uses it."""
    adapter = load_model(name)
    guidance, steps = _guidance(adapter), 4
    cond = _encode(adapter, PROMPTS, 8, guidance)
    negative = _encode(adapter, [""] * 2, 8) if adapter.needs_negative(guidance) else None
    scheduler = make_scheduler("euler", adapter.pipeline.scheduler)
    x0 = adapter.sample(scheduler, cond, steps, RESOLUTION, torch.Generator().manual_seed(5), guidance, negative)

    sigmas = training_sigmas(adapter.pipeline.scheduler, steps, **adapter.timestep_kwargs(steps, RESOLUTION))
    assert sigmas[0] > sigmas[-1] > 0 and len(sigmas) == steps
    x = _initial_noise(adapter, 2, 5)
    with torch.no_grad():
        for i, s in enumerate(sigmas):
            v = adapter.predict(adapter.transformer, x, s.expand(2), cond)
            if negative is not None:
                v_neg = adapter.predict(adapter.transformer, x, s.expand(2), negative)
                v = adapter.guided_velocity(v, v_neg, guidance)
            nxt = sigmas[i + 1] if i + 1 < steps else torch.tensor(0.0)
            x = x + (nxt - s) * v
    assert (x0 - x).abs().max() < 1e-4 * x0.abs().max(), (x0 - x).abs().max()
    other = adapter.sample(scheduler, _encode(adapter, PROMPTS, 8, 1.0), steps, RESOLUTION,
                           torch.Generator().manual_seed(5), 1.0)  # fmt: skip
    assert (other - x0).abs().max() > 1e-4, "vacuous: guidance changes nothing"


@pytest.mark.parametrize("name", TINY_NAMES)
def test_velocity_convention_x0_is_x_t_minus_t_v(name):
    """The family scheduler's last Euler step (to sigma = 0) with ``v = eps - x0`` lands on ``x0 = x_t - t v``."""
    adapter = load_model(name)
    scheduler = make_scheduler("euler", adapter.pipeline.scheduler)
    scheduler.set_timesteps(3, **adapter.timestep_kwargs(3, RESOLUTION))
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    t = scheduler.sigmas[2]
    x_t = add_noise(x0, eps, t.expand(2))
    scheduler._step_index = 2
    out = scheduler.step(eps - x0, scheduler.timesteps[2], x_t, return_dict=False)[0]
    torch.testing.assert_close(out, x0, rtol=1e-5, atol=1e-5)
    terms = nft_loss_terms(eps - x0, eps - x0, x_t, x0, t.expand(2), 1.0)  # the NFT loss's x0_hat: zero error
    assert terms.loss_pos.abs().max() < 1e-8  # float32 rounding of x_t


@pytest.mark.parametrize("name", TINY_NAMES)
def test_per_reward_gradients_equal_explicit_autograd_float64(name):
    from peft import LoraConfig

    adapter = load_model(name, torch_dtype=torch.float64)
    transformer = adapter.transformer
    transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian", target_modules=list(adapter.default_lora_targets))
    )
    transformer.double()  # peft builds the LoRA layers in float32
    with torch.no_grad():  # gaussian init zeroes lora_B: perturb it so that gradients wrt lora_A are non-trivial
        for n, p in transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    params = [p for p in transformer.parameters() if p.requires_grad]
    cond = _encode(adapter, PROMPTS * 2, 8, _guidance(adapter))
    g = torch.Generator().manual_seed(1)
    shape = _initial_noise(adapter, 4, 0).shape
    x0, eps = (
        torch.randn(shape, generator=g, dtype=torch.float64),
        torch.randn(shape, generator=g, dtype=torch.float64),
    )
    t = torch.rand(4, generator=g, dtype=torch.float64) * 0.8 + 0.1
    x_t = add_noise(x0, eps, t)
    v_old = torch.randn(shape, generator=g, dtype=torch.float64)
    r = torch.rand(3, 4, generator=g, dtype=torch.float64)

    def terms():
        return nft_loss_terms(adapter.predict(transformer, x_t, t, cond), v_old, x_t, x0, t, 1.0)

    expected = explicit_per_reward_gradients(terms, r, params)
    assert expected.abs().max() > 1e-8
    for engine_name in ("reference", "two_stream"):
        engine = make_gradient_engine(engine_name, params, 3, transformer)
        with engine.capture(transformer):
            lt = terms()
            engine.accumulate(lt.loss_pos, lt.loss_neg, r, 1.0)
        err = (engine.buffers - expected).abs().max() / expected.abs().max()
        # The reference engine runs the same backward: float64 exact. The two-stream engine's two backward passes
        # have other cotangents, and diffusers computes RMSNorm variances and rotary embeddings in float32 even in
        # a float64 model (`.to(torch.float32)`, `x.float()`), so linearity holds to float32 rounding there (~1e-8
        # measured; test_engines checks 1e-10 on a transformer without those float32 islands).
        assert err < (1e-12 if engine_name == "reference" else 1e-6), (engine_name, err.item())


@pytest.mark.parametrize("name", TINY_NAMES)
def test_prop1_amortised_step_equals_weighted_per_reward_gradients(name, tmp_path):
    """MARBLE Prop. 1 through the trainer on each family: one backward with A_bar = sum_k alpha_k g_k."""
    args = tiny_args(tmp_path, max_steps=1, marble_gradient_engine="reference", lora_target_modules=None)
    trainer = MarbleDiffusionNFTTrainer(name, [brightness, contrast], args=args, train_dataset=_dataset(name))
    assert trainer.args.lora_target_modules == list(trainer.model_adapter.default_lora_targets)
    state = trainer.balancer.state_dict()
    state["alpha_bar"] = [0.7, 0.3]
    trainer.balancer.load_state_dict(state)
    trainer.state.global_step = 1  # an amortised step
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    micro = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), args.gradient_accumulation_steps, CPU)[0]
    trainer.current_gradient_accumulation_steps = len(micro)
    params = list(trainer.trainable_parameters().values())
    trainer.model.zero_grad()
    for mb in micro:
        trainer.training_step(trainer.model, mb)
    amortised = torch.cat([p.grad.reshape(-1) for p in params]).clone()
    trainer.model.zero_grad()
    micro = trainer.start_step(
        [dataclasses.replace(mb, plan=dataclasses.replace(mb.plan, mode="cosines")) for mb in micro]
    )
    for mb in micro:
        trainer.training_step(trainer.model, mb)
    g = trainer._gradient_engine.buffers
    assert amortised.abs().max() > 0
    torch.testing.assert_close(amortised, (0.7 * g[0] + 0.3 * g[1]).float(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", [n for n in TINY_NAMES if n != "tiny"])  # SD3's: test_publish, test_cli
def test_cli_trains_and_the_lora_loads_with_the_family_pipeline(name, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--model_name_or_path", name, "--reward_funcs", "brightness", "jpeg_compressibility"]
    argv += ["--max_steps", "2", "--output_dir", str(out), "--resolution", str(RESOLUTION), "--num_generations", "2"]
    argv += ["--prompts_per_step", "2", "--per_device_train_batch_size", "4", "--num_sample_steps", "2"]
    argv += ["--max_sequence_length", "8", "--learning_rate", "5e-2", "--report_to", "none", "--use_cpu", "true"]
    argv += ["--sample_grid_prompts", "0", "--eval_before_after", "false", "--sample_scheduler", "euler"]
    if family_of(name).editing:  # an editing family trains on instructions with their source images
        argv += ["--dataset_name", "shapes_edit"]
    assert main(argv) == 0
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["global_step"] == 2

    fresh = load_model(name)
    fresh.pipeline.load_lora_weights(str(out))  # the family pipeline's own loader
    state = fresh.transformer.state_dict()
    assert any("lora_A" in k for k in state)


@pytest.mark.parametrize("name", [n for n in TINY_NAMES if n != "tiny"])  # SD3's: test_publish
def test_saved_lora_reproduces_the_trainers_samples_in_the_family_pipeline(name, tmp_path):
    video = family_of(name).video
    args = tiny_args(tmp_path, max_steps=2, learning_rate=5e-2, lora_target_modules=None,
                     **({"num_frames": 3} if video else {}))  # fmt: skip
    trainer = MarbleDiffusionNFTTrainer(name, [brightness, contrast], args=args, train_dataset=_dataset(name))
    trainer.train()
    folder = tmp_path / "lora"
    trainer.save_model(str(folder))
    sources = _sources(trainer.model_adapter, len(PROMPTS))
    ours = trainer.generate(PROMPTS, seed=3, **sources)
    base = trainer.generate(PROMPTS, seed=3, use_lora=False, **sources)
    assert (ours - base).abs().max() > 1e-4, "vacuous: the LoRA changes nothing"

    fresh = load_model(name)
    fresh.pipeline.load_lora_weights(str(folder))  # the family pipeline's own loader
    fresh.num_frames = getattr(trainer.model_adapter, "num_frames", None)
    cond = fresh.encode(PROMPTS, args.max_sequence_length, CPU, args.guidance_scale, **sources)
    scheduler = make_scheduler(args.sample_scheduler, fresh.pipeline.scheduler)
    latents = fresh.sample(scheduler, cond, args.num_sample_steps, args.resolution, torch.Generator().manual_seed(3),
                           args.guidance_scale)  # fmt: skip
    torch.testing.assert_close(fresh.decode(latents), ours, rtol=1e-4, atol=1e-4)

    # `marble-trl generate`'s path (the sampling settings from marble_trl.json), and the card's snippet.
    config = json.loads((folder / "marble_trl.json").read_text())
    assert config["pipeline_class"] == trainer.model_adapter.pipeline_class_name and config["base_model"] == name
    torch.testing.assert_close(generate_images(name, PROMPTS, folder, seed=3, **sources), ours, rtol=1e-4, atol=1e-4)
    exported = tmp_path / "export"
    assert main(["export", "--checkpoint", str(folder), "--output", str(exported)]) == 0
    snippet = re.search(r"```python\n(.*?)```", (exported / "README.md").read_text(), re.S).group(1)
    scope: dict = {}
    if sources:  # the card's snippet loads the image to edit
        to_pil(sources["source_images"][:1])[0].save(tmp_path / "source.png")
        snippet = snippet.replace("path/to/your/image.png", str(tmp_path / "source.png"))
    exec(snippet.replace("path/to/this/folder", str(exported)), scope)
    assert len(scope["video" if video else "image"]) if video else scope["image"].size == (RESOLUTION, RESOLUTION)
