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
from test_launchers import ACCELERATE, RECIPE, ROOT, _env, _run

ARGS = [
    "--config", str(RECIPE), "--reward_funcs", "brightness", "contrast", "--max_steps", "3",
    "--per_device_train_batch_size", "4", "--disable_tqdm", "true", "--sample_grid_prompts", "0",
    "--optim", "sgd", "--learning_rate", "0.1", "--use_peft", "false", "--beta", "0.01", "--param_ema", "true",
    "--marble_procedure", "released", "--marble_gradient_engine", "layer_gram", "--marble_refresh_interval", "2",
    "--save_strategy", "steps", "--save_steps", "1",
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


def _launch(out: Path, config: str, script: list[str], extra: tuple[str, ...] = ()):
    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE / config)]
        return cmd + ["--num_processes", "2", "--main_process_port", str(port), *script, "train", *ARGS,
                      "--output_dir", str(out), *extra]  # fmt: skip

    return _run(command, _env(ACCELERATE_USE_CPU="true"), out, product=TRANSFORMER)


@pytest.mark.slow
def test_fsdp2_full_finetuning_matches_ddp_and_resumes_exactly(tmp_path):
    fsdp, ddp = tmp_path / "fsdp2", tmp_path / "ddp"
    shim = [str(ROOT / "tests" / "dist" / "fsdp_cpu.py")]
    evaluation = _eval_args(tmp_path)
    _launch(fsdp, "fsdp2.yaml", shim, evaluation)
    _launch(ddp, "multi_gpu.yaml", ["-m", "marble_trl.cli"], evaluation)
    ranks = [json.loads((fsdp / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for state in ranks:
        assert state["distributed_type"] == "DistributedType.FSDP"
        assert state["sharded"] == state["params"] > 0  # every trained weight is a DTensor
    assert ranks[0]["local_numel"] + ranks[1]["local_numel"] == ranks[0]["numel"]  # the shards partition them
    assert ranks[0]["balancer"] == ranks[1]["balancer"] and ranks[0]["balancer"]["num_solves"] > 2
    # the released procedure on the same two processes' micro-batches: DDP's weights and coefficients
    a, b = load_file(str(fsdp / TRANSFORMER)), load_file(str(ddp / TRANSFORMER))
    start = load_file(str(fsdp / "checkpoint-1" / TRANSFORMER))
    assert a.keys() == b.keys()
    moved = max((b[n] - start[n]).abs().max().item() for n in b)
    assert moved > 1e-4
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5 * moved, msg=name)
    ddp_balancer = json.loads((ddp / "checkpoint-3" / "marble_balancer.json").read_text())
    fsdp_balancer = json.loads((fsdp / "checkpoint-3" / "marble_balancer.json").read_text())
    torch.testing.assert_close(
        torch.tensor(fsdp_balancer["alpha_bar"]), torch.tensor(ddp_balancer["alpha_bar"]), atol=1e-4, rtol=0
    )
    # the checkpoint's old policy and EMA are whole tensors, gathered from the shards
    for file in ("old_policy.safetensors", "param_ema.safetensors"):
        mine, theirs = (load_file(str(run / "checkpoint-3" / file)) for run in (fsdp, ddp))
        assert mine.keys() == theirs.keys() and all(mine[n].shape == theirs[n].shape for n in mine), file
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5 * moved, msg=file)
    # the evaluation at step 2 drew with the EMA swapped into the shards: DDP's scores
    scores = [
        {k: v for row in _metrics(run) for k, v in row.items() if k.startswith("eval_rewards/")} for run in (fsdp, ddp)
    ]
    assert scores[0] and scores[0].keys() == scores[1].keys()
    for key in scores[0]:
        assert scores[0][key] == pytest.approx(scores[1][key], abs=1e-4), key
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


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
