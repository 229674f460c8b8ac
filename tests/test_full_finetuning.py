"""Full fine-tuning (``use_peft=False``): the old policy and the reference as swapped-in copies, their exact soft
update, per-reward gradients over the transformer's own weights equal to explicit autograd (two families), training
that moves only the selected weights, an exact resume, and a saved transformer that plain diffusers loads and that
gives the trainer's outputs."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import brightness, contrast, explicit_per_reward_gradients, tiny_args

from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
from marble_trl.balance import make_gradient_engine
from marble_trl.data.prompts import load_prompt_dataset
from marble_trl.models import load_model
from marble_trl.policy.full import FullEMA, FullPolicy, full_parameters
from marble_trl.policy.nft import add_noise, nft_loss_terms
from marble_trl.policy.switch import use_old_weights, use_reference_weights
from marble_trl.rollout.solvers import make_scheduler

CPU = torch.device("cpu")
PROMPTS = ["a red apple", "a blue boat on a lake"]
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


def _inputs(adapter, n: int, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    cond = adapter.encode(PROMPTS * (n // 2), 8, CPU, 1.0 if adapter.family != "flux" else 3.5)
    shape = adapter.sample(
        make_scheduler("euler", adapter.pipeline.scheduler), cond, 1, 16, torch.Generator().manual_seed(0)
    ).shape
    x0, eps = torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)
    t = torch.rand(n, generator=g, dtype=dtype) * 0.8 + 0.1
    return cond, x0, add_noise(x0, eps, t), t, torch.randn(shape, generator=g, dtype=dtype)


def _perturb(params: dict[str, torch.nn.Parameter], seed: int, size: float = 0.01) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * size)


def test_old_policy_and_reference_forwards_are_those_of_their_weights_and_swap_back():
    adapter = load_model("tiny")
    transformer = adapter.transformer
    loaded = {n: p.detach().clone() for n, p in transformer.named_parameters()}
    policy = FullPolicy(transformer, ATTENTION)
    trained = policy.trainable(transformer)
    assert trained and all(
        any(n.endswith(f"{m}.weight") or n.endswith(f"{m}.bias") for m in ATTENTION) for n in trained
    )
    assert {n for n, p in transformer.named_parameters() if p.requires_grad} == set(trained)
    _perturb(trained, 0)  # the trained weights move; the old policy is still the loaded weights
    policy.update(transformer, 0.5)  # old = (loaded + trained) / 2
    cond, _, x_t, t, _ = _inputs(adapter, 2)
    storage = {n: p.data_ptr() for n, p in trained.items()}
    with torch.no_grad():
        now = adapter.predict(transformer, x_t, t, cond)
        with use_old_weights(transformer):
            old = adapter.predict(transformer, x_t, t, cond)
        with use_reference_weights(transformer):
            ref = adapter.predict(transformer, x_t, t, cond)
        old_weights = {n: (loaded[n] + trained[n]) / 2 for n in trained}
        with _swap(transformer, old_weights):
            expected_old = adapter.predict(transformer, x_t, t, cond)
        with _swap(transformer, {n: loaded[n] for n in trained}):
            expected_ref = adapter.predict(transformer, x_t, t, cond)
    torch.testing.assert_close(old, expected_old, rtol=1e-6, atol=1e-6)
    assert torch.equal(ref, expected_ref)  # the reference is the loaded weights, bit for bit
    assert not torch.allclose(now, ref) and not torch.allclose(now, old)
    assert {n: p.data_ptr() for n, p in policy.trainable(transformer).items()} == storage  # swapped back


class _swap:
    """Copy ``weights`` into the parameters (the slow, obvious way) and restore them."""

    def __init__(self, module, weights):
        self.params, self.weights = dict(module.named_parameters()), weights

    def __enter__(self):
        self.saved = {n: self.params[n].detach().clone() for n in self.weights}
        with torch.no_grad():
            for n, w in self.weights.items():
                self.params[n].copy_(w)

    def __exit__(self, *exc):
        with torch.no_grad():
            for n, w in self.saved.items():
                self.params[n].copy_(w)


def test_soft_update_and_ema_follow_the_formula_in_float32():
    adapter = load_model("tiny")
    transformer = adapter.transformer
    policy = FullPolicy(transformer, None)
    trained = policy.trainable(transformer)
    assert set(trained) == {n for n, _ in transformer.named_parameters()}  # default: every weight
    assert all(p.dtype == torch.float32 for p in trained.values())
    ema = FullEMA(transformer)
    old0 = {n: t.clone() for n, t in policy.old.items()}
    _perturb(trained, 1)
    policy.update(transformer, 0.9)
    ema.update(transformer, 0.75)
    for n, p in trained.items():  # float32 arithmetic: to its rounding (the update is one multiply-add per weight)
        exact = old0[n].double() * 0.9 + p.detach().double() * 0.1
        torch.testing.assert_close(policy.old[n].double(), exact, rtol=3e-7, atol=1e-9)
        exact = old0[n].double() * 0.75 + p.detach().double() * 0.25
        torch.testing.assert_close(ema.shadow[n].double(), exact, rtol=3e-7, atol=1e-9)
    before = {n: p.detach().clone() for n, p in trained.items()}
    shadow = {n: t.clone() for n, t in ema.shadow.items()}
    with ema.swapped_in(transformer):  # a pointer swap: no copy of the transformer
        assert all(torch.equal(p, shadow[n]) for n, p in trained.items())
    assert all(torch.equal(p, before[n]) for n, p in trained.items())
    assert all(torch.equal(ema.shadow[n], shadow[n]) for n in shadow)  # the EMA is intact afterwards


def test_v_ref_after_v_old_in_one_autocast_region_is_the_references():
    """An fp32 model under bf16 autocast: autocast caches its bf16 copy of a float32 parameter by the parameter, which
    a .data swap keeps; the swap clears the cache, so the reference forward does not reuse the old policy's weights
    (timestep_inputs computes both in one autocast region)."""
    adapter = load_model("tiny")
    transformer = adapter.transformer
    policy = FullPolicy(transformer, None)
    _perturb(policy.trainable(transformer), 2, 0.05)
    policy.update(transformer, 0.0)  # old = trained != reference
    _perturb(policy.trainable(transformer), 3, 0.05)
    cond, _, x_t, t, _ = _inputs(adapter, 2)
    region = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        with region:
            with use_old_weights(transformer):
                v_old = adapter.predict(transformer, x_t, t, cond)
            with use_reference_weights(transformer):
                v_ref = adapter.predict(transformer, x_t, t, cond)
        with torch.autocast("cpu", dtype=torch.bfloat16), use_reference_weights(transformer):
            alone = adapter.predict(transformer, x_t, t, cond)
    assert torch.equal(v_ref, alone) and not torch.allclose(v_ref, v_old, atol=0.1)


def test_modules_that_match_nothing_are_refused_with_the_field_named():
    transformer = load_model("tiny").transformer
    with pytest.raises(ValueError, match="full_finetune_modules=\\['nope'\\] matched no module"):
        FullPolicy(transformer, ["nope"])
    assert full_parameters(transformer, ["to_q"]) and all(
        ".to_q." in n for n in full_parameters(transformer, ["to_q"])
    )


@pytest.mark.parametrize("targets", [None, ATTENTION], ids=["every_weight", "attention"])
@pytest.mark.parametrize("name", ["tiny", "tiny-flux"])
def test_per_reward_gradients_over_full_weights_equal_explicit_autograd_float64(name, targets):
    """The engines over the transformer's own weights: every weight (convolutions and norms included: `auto` takes
    the reference engine, K backward passes) or the attention's Linear layers (`auto` takes the two-stream engine)."""
    adapter = load_model(name, torch_dtype=torch.float64)
    transformer = adapter.transformer.double()
    policy = FullPolicy(transformer, targets)
    assert all(p.dtype == torch.float32 for p in policy.trainable(transformer).values())
    transformer.double()  # the policy's float32 weights, back to float64 for an exact comparison
    params = list(policy.trainable(transformer).values())
    cond, x0, x_t, t, v_old = _inputs(adapter, 4, torch.float64)
    r = torch.rand(3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def terms():
        return nft_loss_terms(adapter.predict(transformer, x_t, t, cond), v_old, x_t, x0, t, 1.0)

    expected = explicit_per_reward_gradients(terms, r, params, allow_unused=True)
    assert expected.abs().max() > 1e-8
    auto = make_gradient_engine("auto", params, 3, transformer)
    assert type(auto).__name__ == ("ReferenceGradientEngine" if targets is None else "TwoStreamGradientEngine")
    # two-stream: float32 islands of diffusers (RMSNorm variances, rotary embeddings) bound it to ~1e-8 (test_families)
    for engine, tol in ((make_gradient_engine("reference", params, 3, transformer), 1e-12), (auto, 1e-7)):
        with engine.capture(transformer):
            lt = terms()
            engine.accumulate(lt.loss_pos, lt.loss_neg, r, 1.0)
        assert (engine.buffers - expected).abs().max() / expected.abs().max() < tol, type(engine).__name__
        gram = expected @ expected.T
        torch.testing.assert_close(engine.buffers @ engine.buffers.T, gram, rtol=10 * tol, atol=1e-12)
    # layer_gram: the Gram alone, from the forward on the batch twice (L_pos from the first copy, L_neg the second)
    engine = make_gradient_engine("layer_gram", params, 3, transformer)
    twice = torch.arange(4).repeat(2)
    with engine.capture(transformer):
        v = adapter.predict(transformer, x_t[twice], t[twice], cond.index(twice))
        lt = nft_loss_terms(v, v_old[twice], x_t[twice], x0[twice], t[twice], 1.0)
        engine.accumulate(lt.loss_pos, lt.loss_neg, r, 1.0)
    torch.testing.assert_close(engine.gram, expected @ expected.T, rtol=1e-7, atol=1e-12)


def _train(tmp_path, name: str, **overrides) -> MarbleDiffusionNFTTrainer:
    args = tiny_args(tmp_path / name, use_peft=False, beta=0.01, **overrides)
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness, contrast], args=args, train_dataset=load_prompt_dataset())
    return trainer


def test_full_finetuning_trains_only_the_selected_weights_and_resumes_exactly(tmp_path):
    common = dict(max_steps=4, full_finetune_modules=ATTENTION, param_ema=True, learning_rate=1e-3)
    straight = _train(tmp_path, "straight", **common)
    loaded = {n: p.detach().clone() for n, p in straight.transformer.named_parameters()}
    straight.train()
    trained = straight.trainable_parameters()
    moved = [n for n in trained if not torch.equal(trained[n], loaded[n])]
    assert len(moved) == len(trained)
    frozen = [n for n, p in straight.transformer.named_parameters() if n not in trained]
    assert frozen and all(torch.equal(dict(straight.transformer.named_parameters())[n], loaded[n]) for n in frozen)
    assert all(torch.equal(straight.full_policy.reference[n], loaded[n]) for n in trained)  # the reference stays

    first = _train(tmp_path, "resumed", save_strategy="steps", save_steps=2, **{**common, "max_steps": 2})
    first.train()
    checkpoint = tmp_path / "resumed" / "checkpoint-2"
    assert (checkpoint / "transformer" / "config.json").is_file()
    resumed = _train(tmp_path, "resumed", save_strategy="steps", save_steps=2, **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for n, p in straight.trainable_parameters().items():
        assert torch.equal(resumed.trainable_parameters()[n], p), n
        assert torch.equal(resumed.full_policy.old[n], straight.full_policy.old[n]), n
        assert torch.equal(resumed.param_ema.shadow[n], straight.param_ema.shadow[n]), n


def test_the_saved_transformer_loads_in_diffusers_and_gives_the_trainers_outputs(tmp_path):
    from diffusers import SD3Transformer2DModel

    trainer = _train(tmp_path, "run", max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = SD3Transformer2DModel.from_pretrained(str(tmp_path / "final" / "transformer"))
    cond, _, x_t, t, _ = _inputs(trainer.model_adapter, 2)
    with torch.no_grad():
        ours = trainer.model_adapter.predict(trainer.transformer, x_t, t, cond)
        theirs = trainer.model_adapter.predict(loaded, x_t, t, cond)
    assert torch.equal(ours, theirs)
    # plain diffusers: a fresh base pipeline with the saved transformer draws the trainer's pipeline's images
    fresh = load_model("tiny").pipeline
    fresh.transformer = loaded

    def images(pipe):
        out = pipe(PROMPTS, num_inference_steps=2, height=16, width=16, guidance_scale=1.0, max_sequence_length=8,
                   generator=torch.Generator().manual_seed(3), output_type="pt")  # fmt: skip
        return out.images

    with torch.no_grad():
        assert torch.equal(images(trainer.pipeline), images(fresh))
        assert not torch.equal(images(load_model("tiny").pipeline), images(fresh))  # the base draws other images
    assert trainer.pipeline.transformer is trainer.transformer  # the trainer's pipeline runs the trained weights


def test_bad_combinations_are_refused_with_the_way_out(tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="full_finetune_modules=\\['to_q'\\] is for full fine-tuning"):
        MarbleDiffusionNFTConfig(output_dir=str(tmp_path), full_finetune_modules=["to_q"])
    with pytest.raises(ValueError, match="peft_config was given with use_peft=False"):
        MarbleDiffusionNFTTrainer(
            "tiny", [brightness], args=tiny_args(tmp_path, use_peft=False), train_dataset=load_prompt_dataset(),
            peft_config=LoraConfig(r=2, target_modules=["to_q"]),
        )  # fmt: skip
    lora = MarbleDiffusionNFTTrainer(
        "tiny", [brightness, contrast], args=tiny_args(tmp_path / "lora", save_strategy="steps", save_steps=1),
        train_dataset=load_prompt_dataset(),
    )  # fmt: skip
    lora.train()
    full = _train(tmp_path, "lora", max_steps=2)
    with pytest.raises(ValueError, match="use_peft True -> False cannot change on resume"):
        full.train(resume_from_checkpoint=str(tmp_path / "lora" / "checkpoint-1"))


def test_a_full_checkpoint_exports_generates_and_evaluates_through_the_cli(tmp_path):
    from diffusers import AutoModel

    from marble_trl.cli import main
    from marble_trl.publish.export import generate_images

    trainer = _train(tmp_path, "run", max_steps=2, save_strategy="steps", save_steps=2, param_ema=True)
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    for flags, expected in (([], trainer.trainable_parameters()), (["--ema"], trainer.param_ema.shadow)):
        out = tmp_path / f"export{'-'.join(flags)}"
        assert main(["export", "--checkpoint", str(checkpoint), "--output", str(out), *flags]) == 0
        exported = dict(AutoModel.from_pretrained(str(out / "transformer")).named_parameters())
        assert all(torch.equal(exported[n], p.detach()) for n, p in expected.items())
        card = (out / "README.md").read_text()
        assert "A full fine-tune of the transformer of" in card and 'AutoModel.from_pretrained("' in card
        assert "- lora" not in card and ("parameter EMA" in card) == bool(flags)
    # generate: the exported folder through plain diffusers loading draws the trainer's images
    ours = trainer.generate(PROMPTS, seed=3)
    torch.testing.assert_close(
        generate_images("tiny", PROMPTS, tmp_path / "export", seed=3), ours, rtol=1e-5, atol=1e-5
    )
    assert not torch.allclose(generate_images("tiny", PROMPTS, None, seed=3, **_sampling(trainer)), ours, atol=1e-3)
    argv = ["evaluate", "--lora", str(tmp_path / "export"), "--reward_funcs", "brightness", "--max_prompts", "2"]
    argv += ["--num_sample_steps", "2", "--resolution", "16", "--output", str(tmp_path / "eval")]
    assert main(argv) == 0
    results = (tmp_path / "eval" / "results.csv").read_text().splitlines()
    assert len(results) == 3 and results[1].split(",")[1] != results[2].split(",")[1]  # base and fine-tune differ


def _sampling(trainer) -> dict:
    args = trainer.args
    return dict(num_inference_steps=args.num_sample_steps, resolution=args.resolution, scheduler=args.sample_scheduler,
                max_sequence_length=args.max_sequence_length, guidance_scale=args.guidance_scale)  # fmt: skip


def test_a_failed_full_run_leaves_an_emergency_checkpoint_that_resumes(tmp_path):
    """A reward failing in step 3: the emergency checkpoint of step 2 holds the trained transformer, the old policy
    and the EMA (all checked finite), validates, and a resumed run finishes."""
    from marble_trl.persistence.resume import validate_checkpoint

    calls, poison = [], []

    def failing(prompts, images, **_):
        calls.append(1)
        if len(calls) == 3:
            for policy in poison:  # the old policy's copy goes NaN after two completed steps
                with torch.no_grad():
                    policy.old[policy.names[0]].fill_(float("nan"))
            raise RuntimeError("reward server went away")
        return brightness(prompts, images)

    failing.__name__ = "brightness"  # the resumed run's reward has the same name
    args = tiny_args(tmp_path / "run", use_peft=False, max_steps=4, param_ema=True, beta=0.01)
    trainer = MarbleDiffusionNFTTrainer("tiny", [failing, contrast], args=args, train_dataset=load_prompt_dataset())
    with pytest.raises(Exception, match="reward server went away"):
        trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert trainer.emergency_checkpoint == str(checkpoint)
    validate_checkpoint(checkpoint)
    assert (checkpoint / "transformer" / "config.json").is_file() and (checkpoint / "old_policy.safetensors").is_file()
    resumed = MarbleDiffusionNFTTrainer("tiny", [brightness, contrast], args=args, train_dataset=load_prompt_dataset())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4

    # the old policy's copy gone NaN before the failure: no emergency checkpoint (it would resume NaN)
    calls.clear()
    args = tiny_args(tmp_path / "nan", use_peft=False, max_steps=4, beta=0.01)
    broken = MarbleDiffusionNFTTrainer("tiny", [failing, contrast], args=args, train_dataset=load_prompt_dataset())
    poison.append(broken.full_policy)
    with pytest.raises(Exception, match="reward server went away"):
        broken.train()
    assert broken.state.global_step == 2
    assert broken.emergency_checkpoint is None and not (tmp_path / "nan" / "checkpoint-2").exists()


def test_the_cli_fine_tunes_another_family_whose_folder_plain_diffusers_loads(tmp_path):
    """tiny FLUX through `marble-trl train --use_peft false`: its transformer/ loads with diffusers' FluxTransformer2DModel
    and `generate` (marble_trl.json's sampling) draws what the loaded transformer draws in the family's sampler."""
    from diffusers import FluxTransformer2DModel

    from marble_trl.cli import main
    from marble_trl.publish.export import generate_images

    out = tmp_path / "run"
    argv = ["train", "--model_name_or_path", "tiny-flux", "--reward_funcs", "brightness", "jpeg_compressibility"]
    argv += ["--max_steps", "2", "--output_dir", str(out), "--resolution", "16", "--num_generations", "2"]
    argv += ["--prompts_per_step", "2", "--per_device_train_batch_size", "4", "--num_sample_steps", "2"]
    argv += ["--max_sequence_length", "8", "--learning_rate", "1e-3", "--report_to", "none", "--use_cpu", "true"]
    argv += ["--sample_grid_prompts", "0", "--eval_before_after", "false", "--sample_scheduler", "euler"]
    assert main([*argv, "--use_peft", "false"]) == 0
    assert not (out / "pytorch_lora_weights.safetensors").exists()
    fresh = load_model("tiny-flux")
    base = dict(fresh.transformer.named_parameters())
    fresh.pipeline.transformer = FluxTransformer2DModel.from_pretrained(str(out / "transformer"))
    tuned = dict(fresh.transformer.named_parameters())
    assert all(tuned[n].shape == p.shape for n, p in base.items())
    assert sum(not torch.equal(tuned[n], p) for n, p in base.items()) > len(base) // 2  # every weight trained
    guidance = json.loads((out / "marble_trl.json").read_text())["sampling"]["guidance_scale"]
    cond = fresh.encode(PROMPTS, 8, CPU, guidance)
    latents = fresh.sample(make_scheduler("euler", fresh.pipeline.scheduler), cond, 2, 16,
                           torch.Generator().manual_seed(3), guidance)  # fmt: skip
    expected = fresh.decode(latents)
    torch.testing.assert_close(generate_images("tiny-flux", PROMPTS, out, seed=3), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(generate_images("tiny-flux", PROMPTS, None, seed=3, num_inference_steps=2,
                                              resolution=16, scheduler="euler", max_sequence_length=8,
                                              guidance_scale=guidance), expected, atol=1e-4)  # fmt: skip


def test_a_bf16_model_trains_float32_weights_and_keeps_its_own_tensors_as_reference(tmp_path):
    """bf16 loading: the trained weights become float32 copies, the reference is the loaded bf16 tensors themselves
    (no copy); without bf16 / fp16 autocast the trainer refuses the run, naming the fix. (The bf16 forward itself is
    not run here: CPU autocast leaves a convolution's float32 bias uncast, which CUDA autocast casts.)"""
    adapter = load_model("tiny", torch_dtype=torch.bfloat16)
    transformer = adapter.transformer
    storage = {n: p.data_ptr() for n, p in transformer.named_parameters()}
    policy = FullPolicy(transformer, None)
    trained = policy.trainable(transformer)
    assert all(p.dtype == torch.float32 for p in trained.values())
    assert all(policy.reference[n].dtype == torch.bfloat16 and policy.reference[n].data_ptr() == storage[n]
               for n in trained)  # fmt: skip
    with pytest.raises(ValueError, match="Set bf16 true \\(or fp16\\), or load the model in float32"):
        MarbleDiffusionNFTTrainer(
            load_model("tiny", torch_dtype=torch.bfloat16).pipeline, [brightness],
            args=tiny_args(tmp_path, use_peft=False), train_dataset=load_prompt_dataset(),
        )  # fmt: skip


def test_a_non_finite_update_of_the_full_weights_is_rolled_back_from_the_host_copy(tmp_path):
    """An update that overflows (an infinite learning rate in step 2): the trained weights and the AdamW state come
    back from the guard's copy, which full fine-tuning keeps in host memory, and training goes on."""
    from transformers import TrainerCallback

    class Overflow(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for group in trainer.optimizer.param_groups:
                group["lr"] = float("inf") if state.global_step == 1 else args.learning_rate

    args = tiny_args(tmp_path, use_peft=False, max_steps=3, max_nonfinite_skips=1, lr_scheduler_type="constant",
                     learning_rate=1e-3)  # fmt: skip
    trainer = MarbleDiffusionNFTTrainer("tiny", [brightness, contrast], args=args, train_dataset=load_prompt_dataset(),
                                        callbacks=[Overflow()])  # fmt: skip
    trainer.train()
    assert trainer.nonfinite_guard.total == 1 and trainer.state.global_step == 3
    assert all(torch.isfinite(p).all() for p in trainer.trainable_parameters().values())
    values, _ = trainer.nonfinite_guard._snapshot
    assert all(v.device.type == "cpu" for v in values.values())
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    for p, s in inner.state.items():
        assert all(
            torch.isfinite(v).all() and v.device == p.device
            for k, v in s.items()
            if torch.is_tensor(v) and k != "step"
        )


def test_sharded_backends_refusals_name_the_way_out(tmp_path):
    """With sharded weights (FSDP2, DeepSpeed ZeRO-3) full fine-tuning's MARBLE takes the released procedure with
    layer_gram (tests/test_full_sharded.py runs both); with whole weights (DDP, ZeRO-2) every engine runs."""
    from types import SimpleNamespace

    from marble_trl.trainer.setup import check_full_finetuning_backend

    fsdp = SimpleNamespace(name="fsdp2", shards_transformer=True)
    zero3 = SimpleNamespace(name="deepspeed", shards_transformer=True)
    zero2 = SimpleNamespace(name="deepspeed", shards_transformer=False)
    released = tiny_args(tmp_path, use_peft=False, marble_procedure="released", marble_gradient_engine="layer_gram")
    for backend, label in ((fsdp, "FSDP2"), (zero3, "DeepSpeed ZeRO-3")):
        with pytest.raises(ValueError, match=f"under {label}: .*marble_gradient_engine='layer_gram'"):
            check_full_finetuning_backend(tiny_args(tmp_path, use_peft=False), backend, "marble")
        check_full_finetuning_backend(tiny_args(tmp_path, use_peft=False), backend, "sum_then_normalize")
        check_full_finetuning_backend(released, backend, "marble")
    check_full_finetuning_backend(tiny_args(tmp_path, use_peft=False), zero2, "marble")
    # DeepSpeed settings whose partitions the swaps do not follow: refused, named, with the way out
    for zero, named in (
        ({"stage": 3, "offload_param": {"device": "cpu"}}, "offload_param device cpu"),
        ({"stage": 3, "zero_hpz_partition_size": 8}, "zero_hpz_partition_size > 1"),
        ({"stage": 3, "zero_quantized_weights": True}, "zero_quantized_weights"),
        ({"stage": 3, "zero_quantized_nontrainable_weights": "true"}, "zero_quantized_nontrainable_weights"),
    ):
        offload = SimpleNamespace(name="deepspeed", shards_transformer=True, zero_config=zero)
        with pytest.raises(ValueError, match=f"does not support {named}.*drop it from the DeepSpeed config"):
            check_full_finetuning_backend(released, offload, "marble")
    stage2 = SimpleNamespace(
        name="deepspeed", shards_transformer=False, zero_config={"offload_param": {"device": "cpu"}}
    )
    check_full_finetuning_backend(released, stage2, "marble")  # ZeRO-2 ignores offload_param: nothing to refuse
    lora = tiny_args(tmp_path)  # a LoRA takes them all
    check_full_finetuning_backend(
        lora,
        SimpleNamespace(name="deepspeed", shards_transformer=True, zero_config={"offload_param": {"device": "cpu"}}),
        "marble",
    )
