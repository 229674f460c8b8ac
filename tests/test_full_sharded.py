"""Full fine-tuning (``use_peft=False``) under FSDP2: every weight of tiny SD3 a ``DTensor`` shard, the old policy,
the reference and the parameter EMA held as this process's shards and swapped shard by shard, MARBLE as released with
the ``layer_gram`` engine (the per-reward Gram of each solved pair, its slices averaged over the processes); the
same weights as DDP on two processes, the same coefficients on both, the transformer gathered into a diffusers folder,
and an exact resume from the sharded checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_launchers import ACCELERATE, RECIPE, ROOT, _env, _run, needs_deepspeed, zero3_config

ARGS = [
    "--config", str(RECIPE), "--reward_funcs", "brightness", "contrast", "--max_steps", "3",
    "--per_device_train_batch_size", "4", "--disable_tqdm", "true", "--sample_grid_prompts", "0",
    "--optim", "sgd", "--learning_rate", "0.1", "--use_peft", "false", "--beta", "0.01", "--param_ema", "true",
    "--marble_procedure", "released", "--marble_gradient_engine", "layer_gram", "--marble_refresh_interval", "2",
    "--save_strategy", "steps", "--save_steps", "1",
    "--num_sample_steps", "3",  # two training timesteps (the recipe's three): ZeRO-3 gathers every layer per forward
]  # fmt: skip
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"


def _eval_args(folder: Path) -> tuple[str, ...]:
    """An evaluation at step 2 on held-out prompts, with the parameter EMA swapped in (eval_use_param_ema)."""
    prompts = folder / "eval_prompts.txt"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text("a red square\na blue circle\n")
    return ("--eval_dataset_name", str(prompts), "--eval_strategy", "steps", "--eval_steps", "2",
            "--eval_num_sample_steps", "2", "--eval_num_images_per_prompt", "2", "--per_device_eval_batch_size", "2",
            "--eval_grid_prompts", "0")  # fmt: skip


def _launch(out: Path, config: str | Path, script: list[str], extra: tuple[str, ...] = (), deepspeed: bool = False):
    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE / config)]
        return cmd + ["--num_processes", "2", "--main_process_port", str(port), *script, "train", *ARGS,
                      "--output_dir", str(out), *extra]  # fmt: skip

    # DeepSpeed without CUDA: DS_ACCELERATOR=cpu and --use_cpu false (test_launchers); the others: accelerate's CPU
    return _run(command, _env() if deepspeed else _env(ACCELERATE_USE_CPU="true"), out, product=TRANSFORMER)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    """The reference: recipes/accelerate/multi_gpu.yaml, two CPU processes (gloo DDP), with the evaluation."""
    folder = tmp_path_factory.mktemp("full-ddp")
    _launch(folder / "ddp", "multi_gpu.yaml", ["-m", "marble_trl.cli"], _eval_args(folder))
    return folder / "ddp"


@pytest.mark.slow
def test_fsdp2_full_finetuning_matches_ddp_and_resumes_exactly(ddp, tmp_path):
    fsdp = tmp_path / "fsdp2"
    shim = [str(ROOT / "tests" / "dist" / "fsdp_cpu.py")]
    evaluation = _eval_args(tmp_path)
    _launch(fsdp, "fsdp2.yaml", shim, evaluation)
    ranks = [json.loads((fsdp / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for state in ranks:
        assert state["distributed_type"] == "DistributedType.FSDP"
        assert state["sharded"] == state["params"] > 0  # every trained weight is a DTensor
    assert ranks[0]["local_numel"] + ranks[1]["local_numel"] == ranks[0]["numel"]  # the shards partition them
    assert ranks[0]["balancer"] == ranks[1]["balancer"] and ranks[0]["balancer"]["num_solves"] > 2
    a = _assert_same_run(fsdp, ddp)
    # the gathered folder is a diffusers model
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel.from_pretrained(str(fsdp / "transformer"))
    assert torch.equal(dict(model.named_parameters())["proj_out.weight"], a["proj_out.weight"])
    # resumed from checkpoint-1 (sharded optimizer state, the copies' shards from the whole files): bit for bit
    final = dict(a)
    (fsdp / TRANSFORMER).unlink()
    _launch(fsdp, "fsdp2.yaml", shim, (*evaluation, "--resume_from_checkpoint", str(fsdp / "checkpoint-1")))
    again = load_file(str(fsdp / TRANSFORMER))
    for name in final:
        assert torch.equal(again[name], final[name]), name


def _assert_same_run(run: Path, ddp: Path) -> dict[str, torch.Tensor]:
    """``run`` trained DDP's weights on the same two processes' micro-batches (the released procedure), with its
    coefficients, whole old policy and EMA in the checkpoints and its evaluation scores (drawn with the EMA swapped
    in); returns the trained weights."""
    a, b = load_file(str(run / TRANSFORMER)), load_file(str(ddp / TRANSFORMER))
    start = load_file(str(run / "checkpoint-1" / TRANSFORMER))
    assert a.keys() == b.keys()
    moved = max((b[n] - start[n]).abs().max().item() for n in b)
    assert moved > 1e-4
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5 * moved, msg=name)
    ddp_balancer = json.loads((ddp / "checkpoint-3" / "marble_balancer.json").read_text())
    run_balancer = json.loads((run / "checkpoint-3" / "marble_balancer.json").read_text())
    torch.testing.assert_close(
        torch.tensor(run_balancer["alpha_bar"]), torch.tensor(ddp_balancer["alpha_bar"]), atol=1e-4, rtol=0
    )
    # the checkpoint's old policy and EMA are whole tensors (under FSDP2 gathered from the shards)
    for file in ("old_policy.safetensors", "param_ema.safetensors"):
        mine, theirs = (load_file(str(folder / "checkpoint-3" / file)) for folder in (run, ddp))
        assert mine.keys() == theirs.keys() and all(mine[n].shape == theirs[n].shape for n in mine), file
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5 * moved, msg=file)
    # the evaluation at step 2 drew with the EMA swapped in: DDP's scores
    scores = [
        {k: v for row in _metrics(folder) for k, v in row.items() if k.startswith("eval_rewards/")}
        for folder in (run, ddp)
    ]
    assert scores[0] and scores[0].keys() == scores[1].keys()
    for key in scores[0]:
        assert scores[0][key] == pytest.approx(scores[1][key], abs=1e-4), key
    return a


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.heavy
@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_zero2_full_finetuning_matches_ddp_and_resumes_exactly(ddp, tmp_path):
    """recipes/accelerate/deepspeed_zero2.yaml over two CPU processes: the optimizer state and gradients of every weight
    partitioned, the weights whole (the old policy, reference and EMA swap by pointer into DeepSpeed's flat buffer);
    DDP's weights, copies and evaluation, and an exact resume from DeepSpeed's engine checkpoint (which restores the
    trained weights: the checkpoint's transformer/ is not read back)."""
    zero2 = tmp_path / "zero2"
    config = ACCELERATE / "deepspeed_zero2.yaml"
    evaluation = (*_eval_args(tmp_path), "--use_cpu", "false")
    _launch(zero2, config, ["-m", "marble_trl.cli"], evaluation, deepspeed=True)
    args = torch.load(zero2 / "training_args.bin", weights_only=False)
    assert args.world_size == 2 and args.ddp_backend == "gloo"
    assert sorted(p.name for p in (zero2 / "checkpoint-1").glob("global_step*"))  # DeepSpeed's engine checkpoint
    _assert_same_run(zero2, ddp)
    final = load_file(str(zero2 / TRANSFORMER))
    (zero2 / TRANSFORMER).unlink()
    resume = (*evaluation, "--resume_from_checkpoint", str(zero2 / "checkpoint-1"))
    _launch(zero2, config, ["-m", "marble_trl.cli"], resume, deepspeed=True)
    again = load_file(str(zero2 / TRANSFORMER))
    for name in final:
        assert torch.equal(again[name], final[name]), name


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_zero3_full_finetuning_matches_ddp_and_resumes_exactly(ddp, tmp_path):
    """recipes/accelerate/deepspeed_zero3.yaml over two CPU processes: every weight of tiny SD3 partitioned (the small
    ones, under the persistence threshold, kept gathered between forwards: the swaps release them), the old policy, the
    reference and the EMA held as this process's partitions and swapped into ``ds_tensor``, the soft update and the
    EMA from DeepSpeed's float32 master partitions, transformer/ gathered; DDP's run, and an exact resume."""
    config = zero3_config(tmp_path, persistence_threshold=100)  # the biases and norms persist, the matrices do not
    zero3 = tmp_path / "zero3"
    evaluation = (*_eval_args(tmp_path), "--use_cpu", "false")
    shim = [str(ROOT / "tests" / "dist" / "deepspeed_dump.py")]
    _launch(zero3, config, shim, evaluation, deepspeed=True)
    ranks = [json.loads((zero3 / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for state in ranks:
        assert state["zero3"] == state["params"] > state["persistent"] > 0  # partitioned; the small ones persist
        # the old policy and the EMA are this process's partitions (padded to an equal size on each process)
        assert state["numel"] / 2 <= state["old_numel"] == state["ema_numel"] < 0.6 * state["numel"]
    assert ranks[0]["balancer"] == ranks[1]["balancer"] and ranks[0]["balancer"]["num_solves"] > 2
    _assert_same_run(zero3, ddp)
    final = load_file(str(zero3 / TRANSFORMER))
    (zero3 / TRANSFORMER).unlink()
    resume = (*evaluation, "--resume_from_checkpoint", str(zero3 / "checkpoint-1"))
    _launch(zero3, config, shim, resume, deepspeed=True)
    again = load_file(str(zero3 / TRANSFORMER))
    for name in final:
        assert torch.equal(again[name], final[name]), name
