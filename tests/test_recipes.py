"""Every shipped recipe parses and validates (no GPU, nothing downloaded): training recipes through the CLI's own
parser and config checks (at the world sizes they are meant for), accelerate configs through accelerate's loader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
# world sizes each recipe is validated at (batching must split into whole micro-batches and whole groups)
# the OCR recipe: 576 images per step in micro-batches of 8 = 72, split over at most 8 processes
WORLD_SIZES = {
    "tiny-cpu.yaml": (1,),  # one process: its 32 images per step are one micro-batch (16 each on 2 processes)
    "tiny-random.yaml": (1, 2),
    "sd35m-marble-24gb.yaml": (1,),
    "sd35m-nft-ocr.yaml": (1, 2, 4, 8),
}
DEFAULT_WORLD_SIZES = (1, 2, 4, 8, 16)


def _parse(recipe: Path, world_size: int, tmp_path: Path):
    from trl import TrlParser

    from marble_trl.cli import MarbleScriptArguments
    from marble_trl.nft_config import MarbleDiffusionNFTConfig

    # A config class that believes it runs on `world_size` processes (the batching checks read world_size).
    fake = type("FakeWorldConfig", (MarbleDiffusionNFTConfig,), {"world_size": property(lambda self: world_size)})
    parser = TrlParser((MarbleScriptArguments, fake))
    # bf16 is validated by TrainingArguments against the local hardware: parse it as False on CPU-only machines.
    return parser.parse_args_and_config(
        ["--config", str(recipe), "--output_dir", str(tmp_path / "out"), "--bf16", "false"]
    )


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    for required in (
        "tiny-cpu.yaml",
        "tiny-random.yaml",
        "sd35m-marble-5rewards.yaml",
        "sd35m-weighted-sum-5rewards.yaml",
        "sd35m-nft-pickscore.yaml",
        "sd35m-nft-ocr.yaml",
        "sd35m-marble-24gb.yaml",
    ):
        assert required in names, f"recipes/{required} is missing"
    configs = {p.name for p in ACCELERATE_CONFIGS}
    for required in (
        "single_gpu.yaml",
        "multi_gpu.yaml",
        "deepspeed_zero2.yaml",
        "deepspeed_zero3.yaml",
        "deepspeed_zero3_offload.yaml",
        "fsdp2.yaml",
        "multi_node.yaml",
    ):
        assert required in configs, f"recipes/accelerate/{required} is missing"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_validates(recipe: Path, tmp_path):
    from marble_trl.rewards import available_rewards

    raw = yaml.safe_load(recipe.read_text())
    for world in WORLD_SIZES.get(recipe.name, DEFAULT_WORLD_SIZES):
        script, cfg = _parse(recipe, world, tmp_path)
        assert cfg.images_per_step % cfg.num_generations == 0
        if cfg.prompts_per_step is not None:
            assert cfg.prompts_per_optimizer_step == cfg.prompts_per_step, (recipe.name, world)
    # rewards are registered names (or dotted paths), their options name rewards of the list
    for spec in script.reward_funcs:
        assert spec in available_rewards() or "." in spec or ":" in spec, f"{recipe.name}: unknown reward {spec!r}"
    assert set(cfg.reward_kwargs or {}) <= set(script.reward_funcs), recipe.name
    if cfg.reward_weights is not None:
        assert len(cfg.reward_weights) == len(script.reward_funcs)
    # the YAML's bf16 wish is what a GPU run gets (the parse above forces it off for this CPU machine)
    if recipe.name.startswith("sd35m"):
        assert raw["bf16"] is True and raw["resolution"] == 512


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_header_says_how_to_launch(recipe: Path):
    header = "\n".join(line for line in recipe.read_text().splitlines() if line.startswith("#"))
    assert "marble-trl train --config recipes/" + recipe.name in header
    if recipe.name.startswith("sd35m"):
        assert "accelerate launch --config_file recipes/accelerate/" in header
        assert re.search(r"GPU", header), f"{recipe.name}: the header does not say what hardware it expects"
    for config in re.findall(r"recipes/accelerate/[\w.-]+\.yaml", header):
        assert (ROOT / config).is_file(), f"{recipe.name} names {config}, which does not exist"


def test_paper_recipe_is_faithful(tmp_path):
    """METHOD.md sections 1 and 4; the weighted-sum baseline differs only in the aggregation."""
    _, marble = _parse(ROOT / "recipes" / "sd35m-marble-5rewards.yaml", 8, tmp_path)
    script, ws = _parse(ROOT / "recipes" / "sd35m-weighted-sum-5rewards.yaml", 8, tmp_path)
    assert script.model_name_or_path == "stabilityai/stable-diffusion-3.5-medium"
    assert script.reward_funcs == ["pickscore", "hpsv2", "clipscore", "ocr", "geneval"]
    assert (marble.lora_r, marble.lora_alpha, marble.learning_rate) == (32, 64, 3e-4)
    assert (marble.num_generations, marble.prompts_per_step, marble.nft_beta) == (24, 48, 0.1)
    assert (marble.marble_rho, marble.marble_refresh_interval, marble.multi_objective_aggregation) == (
        0.7,
        10,
        "marble",
    )
    assert (marble.sample_scheduler, marble.num_sample_steps, marble.guidance_scale) == ("dpm2", 25, 1.0)
    assert "url" not in marble.reward_kwargs["geneval"]  # GenEval in process: no server to provide
    assert script.dataset_name == "marble_5rewards"  # the named mixture: no prompt file to provide
    assert ws.multi_objective_aggregation == "sum_then_normalize"
    same_budget = (
        "num_generations prompts_per_step per_device_train_batch_size num_sample_steps sample_scheduler max_steps "
        "learning_rate nft_beta lora_r resolution scale_rewards"
    ).split()
    assert {k: getattr(ws, k) for k in same_budget} == {k: getattr(marble, k) for k in same_budget}
    _, ocr = _parse(ROOT / "recipes" / "sd35m-nft-ocr.yaml", 8, tmp_path)
    assert (ocr.nft_beta, ocr.old_policy_decay, ocr.num_sample_steps) == (0.1, "delayed", 10)
    assert (ocr.prompts_per_step, ocr.old_policy_update_interval) == (24, 2)  # the reference: 2 steps per epoch
    _, small = _parse(ROOT / "recipes" / "sd35m-marble-24gb.yaml", 1, tmp_path)
    assert small.gradient_checkpointing and small.num_generations < marble.num_generations
    assert small.offload_text_encoders and all(small.reward_kwargs[n]["offload"] for n in ("pickscore", "hpsv2"))


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads(config: Path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DistributedType

    loaded = load_config_from_file(str(config))  # rejects unknown top-level keys
    assert isinstance(loaded, ClusterConfig)
    # nested deepspeed_config keys become `accelerate launch` arguments: each must be one
    dests = {action.dest for action in launch_command_parser()._actions}
    unknown = set(loaded.deepspeed_config) - dests
    assert not unknown, f"{config.name}: deepspeed_config keys accelerate launch does not know: {unknown}"
    if loaded.distributed_type == DistributedType.DEEPSPEED:
        assert loaded.deepspeed_config["zero_stage"] in (2, 3)
        # left to the trainer: it fills them from the recipe and its per-timestep backward loop
        assert "gradient_accumulation_steps" not in loaded.deepspeed_config
    # precision comes from the recipe (bf16: true), never from the launcher
    assert loaded.mixed_precision == "no"
    header = "\n".join(line for line in config.read_text().splitlines() if line.startswith("#"))
    assert "accelerate launch" in header or "--accelerate_config" in header


def test_released_recipe_is_the_release(tmp_path):
    """aim-uofa/MARBLE @ 1bf9543, train.sh rho_07 (docs/marble.md): the released procedure and every released value,
    on the paper recipe's model, rewards and group budget."""
    _, rel = _parse(ROOT / "recipes" / "sd35m-marble-5rewards-released.yaml", 16, tmp_path)
    script, paper = _parse(ROOT / "recipes" / "sd35m-marble-5rewards.yaml", 16, tmp_path)
    assert (rel.marble_procedure, rel.marble_masked_solve, rel.scale_rewards) == ("released", True, "batch")
    assert (rel.marble_refresh_interval, rel.marble_warmup_steps, rel.marble_rho, rel.marble_alpha_floor) == (
        10,
        1,
        0.7,
        0.0,
    )
    assert rel.marble_reward_groups is None and rel.marble_mgda_weights is None and not rel.marble_reward_dropout_prob
    assert (rel.old_policy_decay, rel.param_ema, rel.param_ema_first_step, rel.max_sequence_length) == (
        "marble",
        True,
        1,
        128,
    )
    assert (rel.per_device_train_batch_size, rel.gradient_accumulation_steps) == (9, 8)  # 16 GPUs: the release's
    assert rel.metric_for_best_model == "mean_reward"
    same = (
        "num_generations prompts_per_step num_sample_steps sample_scheduler learning_rate nft_beta beta lora_r".split()
    )
    assert {k: getattr(rel, k) for k in same} == {k: getattr(paper, k) for k in same}
    assert paper.marble_procedure == "paper"
