"""Validation, derived values and documentation of :class:`MarbleDiffusionNFTConfig`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import HfArgumentParser
from trl.trainer.base_config import _BaseConfig

from marble_trl.nft_config import MarbleDiffusionNFTConfig


@pytest.fixture
def make(tmp_path):
    """Build a config with a valid small batch (4 images = one group of 4) unless overridden."""

    def _make(**overrides):
        kwargs = dict(output_dir=str(tmp_path), report_to="none", num_generations=4, per_device_train_batch_size=4)
        kwargs.update(overrides)
        return MarbleDiffusionNFTConfig(**kwargs)

    return _make


# ---------------------------------------------------------------- invalid values name their field

INVALID = [
    ("num_generations", 1),
    ("nft_beta", 0.0),
    ("nft_beta", -0.5),
    ("timestep_fraction", 0.0),
    ("timestep_fraction", 1.5),
    ("old_policy_decay", "cosine"),
    ("scale_rewards", "global"),
    ("multi_objective_aggregation", "mean"),
    ("guidance_scale", 0.5),
    ("marble_rho", 1.0),
    ("marble_rho", -0.1),
    ("lora_r", 0),
    ("lora_target_modules", []),
    ("num_sample_steps", 0),
    ("resolution", 4),
    ("beta", -1e-4),
    ("adv_clip_max", 0.0),
    ("reward_weights", [1.0, float("inf")]),
    ("marble_refresh_interval", 0),
    ("log_update_cosines_interval", 0),
    ("marble_gradient_engine", "fast"),
    ("marble_refresh_update", "both"),
    ("marble_uniform_final_steps", -1),
    ("marble_refresh_subset", -1),
    ("marble_amortised_update", "normalised"),
    ("marble_silent_rewards", "zero"),
    ("param_ema_max_decay", 1.0),
    ("prompts_per_step", 0),
]


@pytest.mark.parametrize("field_name,value", INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_raises_naming_the_field(make, field_name, value):
    with pytest.raises(ValueError, match=field_name):
        make(**{field_name: value})


def test_refresh_subset_needs_gradient_refreshes(make):
    with pytest.raises(ValueError, match="marble_refresh_subset > 0 .* needs marble_refresh_update='gradient'"):
        make(marble_refresh_subset=2, marble_refresh_update="advantage")


@pytest.mark.parametrize(
    "field_name,value",
    [("timestep_fraction", 1.0), ("marble_rho", 0.0), ("guidance_scale", 1.0), ("nft_beta", 0.1), ("beta", 0.0)],
)
def test_boundary_values_are_accepted(make, field_name, value):
    assert getattr(make(**{field_name: value}), field_name) == value


def test_batch_that_cuts_groups_raises(make):
    with pytest.raises(ValueError, match="num_generations=4") as info:
        make(per_device_train_batch_size=3)
    assert "per_device_train_batch_size" in str(info.value)
    with pytest.raises(ValueError, match="num_generations=4"):
        make(per_device_train_batch_size=2, gradient_accumulation_steps=3)


def test_groups_may_span_micro_batches(make):
    cfg = make(per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert cfg.images_per_step == 8
    assert cfg.prompts_per_optimizer_step == 2


@pytest.mark.parametrize("pps,g,per_device,accum", [(6, 4, 4, 6), (48, 24, 8, 144), (1, 4, 2, 2), (3, 2, 6, 1)])
def test_prompts_per_step_derives_gradient_accumulation(make, pps, g, per_device, accum):
    cfg = make(prompts_per_step=pps, num_generations=g, per_device_train_batch_size=per_device)
    assert cfg.gradient_accumulation_steps == accum
    assert cfg.images_per_step == pps * g
    assert cfg.prompts_per_optimizer_step == pps


def test_prompts_per_step_overrides_an_explicit_accumulation(make):
    cfg = make(prompts_per_step=2, gradient_accumulation_steps=7)
    assert cfg.gradient_accumulation_steps == 2


def test_prompts_per_step_not_splittable_into_micro_batches_raises(make):
    with pytest.raises(ValueError, match="prompts_per_step"):
        make(prompts_per_step=3, num_generations=3, per_device_train_batch_size=2)


# ---------------------------------------------------------------- reward_kwargs


def test_reward_kwargs_json_string_is_parsed(make):
    options = {"ocr": {"device": "cpu", "batch_size": 4}, "pickscore": {"dtype": "float16"}}
    assert make(reward_kwargs=json.dumps(options)).reward_kwargs == options


def test_reward_kwargs_dict_is_kept(make):
    assert make(reward_kwargs={"jpeg": {}}).reward_kwargs == {"jpeg": {}}


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", "3"])
def test_reward_kwargs_bad_string_raises(make, bad):
    with pytest.raises(ValueError, match="reward_kwargs"):
        make(reward_kwargs=bad)


def test_command_line_parsing(tmp_path):
    args = [
        "--output_dir", str(tmp_path), "--report_to", "none", "--num_generations", "2",
        "--per_device_train_batch_size", "2", "--prompts_per_step", "3", "--nft_beta", "0.1",
        "--reward_kwargs", '{"ocr": {"device": "cpu"}}', "--reward_weights", "1", "0.5",
        "--lora_target_modules", "attn.to_q", "attn.to_v",
    ]  # fmt: skip
    (cfg,) = HfArgumentParser(MarbleDiffusionNFTConfig).parse_args_into_dataclasses(args)
    assert cfg.reward_kwargs == {"ocr": {"device": "cpu"}}
    assert cfg.reward_weights == [1.0, 0.5]
    assert cfg.lora_target_modules == ["attn.to_q", "attn.to_v"]
    assert cfg.gradient_accumulation_steps == 3
    assert cfg.nft_beta == 0.1


# ---------------------------------------------------------------- defaults and documentation


def new_fields() -> list[dataclasses.Field]:
    parent = {f.name for f in dataclasses.fields(_BaseConfig)}
    return [f for f in dataclasses.fields(MarbleDiffusionNFTConfig) if f.name not in parent]


def test_new_fields_are_the_nft_and_marble_options():
    names = {f.name for f in new_fields()}
    assert {"num_generations", "nft_beta", "beta", "adv_clip_max", "marble_rho", "scale_rewards"} <= names
    assert "output_dir" not in names


@pytest.mark.parametrize(
    "name",
    sorted({f.name for f in new_fields()} | set(MarbleDiffusionNFTConfig.__dict__.get("__annotations__", {}))),
)
def test_every_declared_field_has_help(name):
    field = {f.name: f for f in dataclasses.fields(MarbleDiffusionNFTConfig)}[name]
    help_text = field.metadata.get("help", "")
    assert isinstance(help_text, str) and len(help_text.strip()) > 10, name


def test_reference_defaults(make):
    cfg = make()
    assert cfg.nft_beta == 1.0 and cfg.beta == 1e-4 and cfg.adv_clip_max == 5.0
    assert cfg.timestep_fraction == 0.99 and cfg.old_policy_decay == "linear"
    assert cfg.learning_rate == 3e-4 and cfg.weight_decay == 1e-4 and cfg.max_grad_norm == 1.0
    assert cfg.lora_r == 32 and cfg.lora_alpha == 64 and cfg.lora_init == "gaussian"
    assert cfg.marble_rho == 0.7 and cfg.marble_refresh_interval == 10
    assert cfg.guidance_scale == 1.0 and cfg.scale_rewards == "group"
    assert cfg.remove_unused_columns is False


def test_default_num_generations_is_the_papers():
    field = {f.name: f for f in dataclasses.fields(MarbleDiffusionNFTConfig)}["num_generations"]
    assert field.default == 24


@pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 defaults on where CUDA bf16 exists")
def test_bf16_defaults_false_on_cpu(make):
    assert make().bf16 is False


def test_explicit_bf16_false_is_kept(make):
    assert make(bf16=False).bf16 is False


def test_all_default_config_is_rejected_with_the_fix(tmp_path):
    """Documented in docs/config.md: 8 images per step (TrainingArguments' batch) cannot hold groups of 24."""
    with pytest.raises(ValueError, match="num_generations=24") as info:
        MarbleDiffusionNFTConfig(output_dir=str(tmp_path), report_to="none")
    assert "prompts_per_step" in str(info.value)
