"""Two real CPU processes (gloo): identical LoRA and MARBLE coefficients on both ranks, and the same result as one
process with the same global batch (gradient accumulation instead of data parallelism). The one-process references run
the same worker function in this process (one intra-op thread, as the launched workers): no second launch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "dist" / "tiny_run.py"


def _worker(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _in_process(worker: Path, out: Path, *args) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    with _one_thread():
        return [_worker(worker).run(str(out), *args)]


def _run(
    out: Path, nproc: int, per_device: int, grad_accum: int, steps: int, aggregation: str, policy: str = "lora"
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_endpoint=127.0.0.1:0",
        "--rdzv_backend=c10d",
        str(WORKER),
        str(out),
        str(per_device),
        str(grad_accum),
        str(steps),
        aggregation,
        policy,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.mark.slow
# Each group of 4 is split over the two processes (normalised over the whole group after gather). Groups that sit
# on one process, data parallel with accumulation: tests/test_launchers.py (the multi-node template, DDP).
@pytest.mark.parametrize("per_device, grad_accum", [(2, 2)])
@pytest.mark.parametrize("policy", ["lora", "full"])  # full: use_peft=False, every weight of the transformer
def test_two_processes_match_each_other_and_one_process(tmp_path, per_device, grad_accum, policy):
    steps = 3  # refreshes at steps 0 and 2, an amortised step between
    two = _run(tmp_path / "two", 2, per_device, grad_accum, steps, "marble", policy)
    one = _in_process(WORKER, tmp_path / "one", per_device, 2 * grad_accum, steps, "marble", policy)
    assert two[0]["world"] == 2 and one[0]["world"] == 1
    for name, p0 in two[0]["lora"].items():
        assert torch.equal(p0, two[1]["lora"][name]), f"ranks disagree on {name}"
    assert two[0]["balancer"] == two[1]["balancer"]
    assert two[0]["balancer"]["num_refreshes"] == 2
    # Same global batch, same noise (keyed by global micro-batch): data parallel == gradient accumulation.
    assert two[0]["rewards"][0] == pytest.approx(one[0]["rewards"][0], abs=1e-6)
    assert two[0]["rewards"] == pytest.approx(one[0]["rewards"], abs=1e-4)
    delta_two = torch.cat([(two[0]["lora"][n] - two[0]["init"][n]).flatten() for n in two[0]["lora"]])
    delta_one = torch.cat([(one[0]["lora"][n] - one[0]["init"][n]).flatten() for n in one[0]["lora"]])
    assert delta_one.norm() > 0
    assert (delta_two - delta_one).norm() <= 1e-3 * delta_one.norm()
    torch.testing.assert_close(
        torch.tensor(two[0]["balancer"]["alpha_bar"]), torch.tensor(one[0]["balancer"]["alpha_bar"]), atol=1e-4, rtol=0
    )


@pytest.mark.heavy
@pytest.mark.slow
def test_two_processes_evaluate_and_log_sources_like_one(tmp_path):
    """Evaluation shards (prompt, image) pairs over processes and gathers the scores: two processes log the same
    evaluation (and the same per-source reward metrics) as one process with the same global batch."""
    worker = Path(__file__).parent / "dist" / "tiny_eval.py"

    def run(out: Path, nproc: int, per_device: int, grad_accum: int) -> list[dict]:
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--rdzv_endpoint=127.0.0.1:0", "--rdzv_backend=c10d", str(worker), str(out), str(per_device),
            str(grad_accum),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]

    two = run(tmp_path / "two", 2, 2, 1)
    one = _in_process(worker, tmp_path / "one", 2, 2)
    assert two[0]["world"] == 2 and one[0]["world"] == 1
    eval_two = next(h for h in two[0]["history"] if "eval_samples" in h)
    eval_one = next(h for h in one[0]["history"] if "eval_samples" in h)
    rank1 = next(h for h in two[1]["history"] if "eval_samples" in h)
    assert {k: v for k, v in rank1.items() if "runtime" not in k} == {
        k: v for k, v in eval_two.items() if "runtime" not in k
    }  # every rank holds the gathered result
    assert eval_two["eval_samples"] == eval_one["eval_samples"] == 10.0
    assert eval_two["eval_rewards/texty/count"] == 2.0
    for key, value in eval_one.items():
        if key.startswith("eval_rewards/"):
            assert eval_two[key] == pytest.approx(value, abs=1e-5), key
    train_two = next(h for h in two[0]["history"] if "loss" in h)
    train_one = next(h for h in one[0]["history"] if "loss" in h)
    for key in ("rewards/brightness/plain/mean", "rewards/brightness/ocr/mean", "rewards/texty/ocr/mean"):
        assert train_two[key] == pytest.approx(train_one[key], abs=1e-5), key
    assert "rewards/texty/plain/mean" not in train_one
    assert (tmp_path / "two" / "eval" / "step-1.png").is_file()


def test_fsdp_plugin_is_checked_and_keeps_dtypes():
    """FSDP1 is refused with the fix; an FSDP2 mixed-precision policy (accelerate's, when its config says bf16) is
    replaced by one that gathers every parameter in its own dtype, leaves the inputs (the timestep) alone and reduces
    the gradients in float32; other strategies are left alone."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from marble_trl.distributed import configure_fsdp

    def accelerator(version, policy=None, kind=DistributedType.FSDP):
        plugin = SimpleNamespace(fsdp_version=version, mixed_precision_policy=policy)
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))

    with pytest.raises(ValueError, match="fsdp_version: 2"):
        configure_fsdp(accelerator(1))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
    acc = accelerator(2, bf16)
    configure_fsdp(acc)
    policy = acc.state.fsdp_plugin.mixed_precision_policy
    assert policy.param_dtype is None and policy.output_dtype is None and policy.reduce_dtype == torch.float32
    none = accelerator(2)
    configure_fsdp(none)
    assert none.state.fsdp_plugin.mixed_precision_policy is None  # nothing to change: FSDP2 keeps each dtype
    ddp = accelerator(1, bf16, DistributedType.MULTI_GPU)
    configure_fsdp(ddp)  # not FSDP: untouched, no error
    assert ddp.state.fsdp_plugin.mixed_precision_policy is bf16


def test_fsdp_config_on_one_process_says_it_does_not_shard(tmp_path, monkeypatch, caplog):
    """`--accelerate_config fsdp2.yaml` with one (CPU) process: accelerate drops FSDP without a word; the trainer says
    so (recipes/accelerate/fsdp2.yaml is for GPUs, 2 processes or more)."""
    from tiny import brightness, tiny_args

    from marble_trl import MarbleDiffusionNFTTrainer
    from marble_trl.data.prompts import load_prompt_dataset

    args = tiny_args(tmp_path / "plain")
    with caplog.at_level("WARNING", logger="marble_trl.distributed"):
        MarbleDiffusionNFTTrainer("tiny", brightness, args=args, train_dataset=load_prompt_dataset())
    assert "does NOT shard" not in caplog.text
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` exports for distributed_type: FSDP
    monkeypatch.setenv("FSDP_VERSION", "2")
    args = tiny_args(tmp_path / "fsdp")
    with caplog.at_level("WARNING", logger="marble_trl.distributed"):
        trainer = MarbleDiffusionNFTTrainer("tiny", brightness, args=args, train_dataset=load_prompt_dataset())
    assert not trainer.is_fsdp_enabled
    assert "this run does NOT shard the transformer" in caplog.text and "1 cpu process(es)" in caplog.text


def test_each_backend_answers_the_capability_questions():
    """The trainer asks its back-end, never the launcher: one row per back-end (the launcher tests run each)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from marble_trl.trainer.backends import DeepSpeedBackward, FSDPBackward, PlainBackward, make_backend

    def accelerator(kind, zero_stage=0):
        plugin = SimpleNamespace(zero_stage=zero_stage)
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)

    rows = {
        "ddp": make_backend(accelerator(DistributedType.MULTI_CPU)),
        "zero2": make_backend(accelerator(DistributedType.DEEPSPEED, 2)),
        "zero3": make_backend(accelerator(DistributedType.DEEPSPEED, 3)),
        "fsdp2": make_backend(accelerator(DistributedType.FSDP)),
    }
    assert [type(b) for b in rows.values()] == [PlainBackward, DeepSpeedBackward, DeepSpeedBackward, FSDPBackward]
    table = {
        name: (b.owns_gradients, b.can_skip_step, b.shards_transformer, b.reduces_update_gradient,
               b.update_row_in_engine, b.checkpoint_owner)
        for name, b in rows.items()
    }  # fmt: skip
    assert table == {
        "ddp": (False, True, False, False, False, "trainer"),
        "zero2": (True, False, False, True, True, "deepspeed"),
        "zero3": (True, False, True, True, True, "deepspeed"),
        "fsdp2": (False, True, True, True, False, "fsdp"),
    }
