"""The tiny recipe under real launchers on CPU, against the same recipe in one plain process (same global batch):

- the multi-node template run as two machines of one process each on 127.0.0.1 (two gloo processes, data parallel)
  gives the LoRA of one process with gradient accumulation;
- `marble-trl train --accelerate_config recipes/accelerate/deepspeed_zero2.yaml --num_processes 2` (DeepSpeed ZeRO-2,
  the shipped config, through the CLI's launcher wrapper) and ZeRO-3 with every parameter partitioned over two
  processes (`DS_ACCELERATOR=cpu`, gloo) give the same LoRA too: one optimizer step per GA x T backward calls,
  no double loss scaling, MARBLE's exact Eq. 7 refresh steps (solved first under DeepSpeed: the per-reward gradients
  outside DeepSpeed, then Eq. 7 by Prop. 1 in DeepSpeed's own backward, against Eq. 7 written into ``.grad`` by the
  plain run), the old-policy update, gradient checkpointing and the saved LoRA on gathered ZeRO-3 parameters; and the
  two-process ZeRO-3 run resumed from its first checkpoint ends bit for bit where it ended.

The DeepSpeed tests skip without deepspeed (`pip install "marble-trl[deepspeed]"`) or a C++ compiler (DeepSpeed
JIT-compiles its CPU communication op on first use, ~1-2 minutes once per machine; later runs reuse the build).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-random.yaml"
ACCELERATE = ROOT / "recipes" / "accelerate"
LORA = "pytorch_lora_weights.safetensors"
# 3 steps: MARBLE refreshes at steps 0 and 2 (per-reward gradients + QP + Eq. 7), an amortised step between.
# Continuous rewards: the recipe's JPEG size is piecewise constant in the pixels, so the last-bit differences of an
# all-reduce (vs gradient accumulation) can flip a quantised pixel, change a file size and move a whole step.
TRAIN_ARGS = [
    "--config",
    str(RECIPE),
    "--reward_funcs",
    "brightness",
    "contrast",
    "--max_steps",
    "3",
    "--marble_refresh_interval",
    "2",
    "--activation_checkpointing",
    "true",
    "--sample_grid_prompts",
    "0",
    # the per-step cosines of the update against every reward's gradient (step 2): the update's whole gradient
    "--log_update_cosines",
    "true",
    # micro-batches of 4: the step's 16 images are GA 4 in one process, GA 2 in each of two
    "--per_device_train_batch_size",
    "4",
    "--disable_tqdm",
    "true",
    # Plain SGD: AdamW divides by the root of tiny second moments, so the float summation order of an all-reduce (vs
    # gradient accumulation) could move single weights by ~1e-3 after 3 steps. (AdamW under ZeRO-2 was also checked
    # by hand: bitwise equal to the plain run.)
    "--optim",
    "sgd",
    "--learning_rate",
    "1.0",
]
REFRESH_PAIRS = 6.0  # (micro-batch, timestep) pairs of a step in each of two processes: GA 2 x T 3
# The same recipe on other families: FLUX.1 (the multi-node template), and Qwen-Image under ZeRO-3 with the released
# MARBLE (every pair of step 0 solved, then the first pair of step 2; no cosine diagnostic there).
FLUX_ARGS = [*TRAIN_ARGS, "--model_name_or_path", "tiny-flux"]
_NO_COSINES = [a for i, a in enumerate(TRAIN_ARGS) if "--log_update_cosines" not in TRAIN_ARGS[max(i - 1, 0) : i + 1]]
QWEN_RELEASED_ARGS = [*_NO_COSINES, "--model_name_or_path", "tiny-qwen-image", "--marble_procedure", "released"]
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or shutil.which("c++") is None,
    reason="needs deepspeed (pip install 'marble-trl[deepspeed]') and a C++ compiler for its CPU op",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    # CPU runs on any machine: DS_ACCELERATOR=cpu for DeepSpeed, and no GPU for accelerate to pick instead.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("ACCELERATE_USE_CPU", None)
    env.update(extra)
    return env


_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


def _run(command: Callable[[int], list[str]], env: dict[str, str], out: Path, attempts: int = 3, product: str = LORA):
    """Run ``command(port)`` for a free ``main_process_port``. The port is free when chosen but not reserved: another
    process (say, a second test session on the machine) can bind it first. Then the launch is retried on a new one.
    ``product``: the file or folder the run must leave in ``out``."""
    for attempt in range(attempts):
        proc = subprocess.run(command(_free_port()), env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0 or not _PORT_TAKEN.search(proc.stderr) or attempt == attempts - 1:
            break
        shutil.rmtree(out, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert (out / product).exists()
    return proc


def _steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r and "grad_norm" in r]


def _init_lora(train_args: list[str]) -> dict[str, torch.Tensor]:
    """The recipe's LoRA before training (seeded) under ``train_args``, named as in the saved file."""
    from peft.utils import get_peft_model_state_dict
    from trl import TrlParser

    from marble_trl import MarbleDiffusionNFTTrainer
    from marble_trl.commands.train import MarbleScriptArguments, load_train_dataset
    from marble_trl.nft_config import MarbleDiffusionNFTConfig

    parser = TrlParser((MarbleScriptArguments, MarbleDiffusionNFTConfig))
    script, cfg = parser.parse_args_and_config([*train_args, "--output_dir", "unused"])
    trainer = MarbleDiffusionNFTTrainer(
        script.model_name_or_path, script.reward_funcs, args=cfg, train_dataset=load_train_dataset("bundled")
    )
    state = get_peft_model_state_dict(trainer.transformer, adapter_name="default")
    return {f"transformer.{k}": v.detach().clone() for k, v in state.items()}


@pytest.fixture(scope="module")
def init_lora() -> dict[str, torch.Tensor]:
    return _init_lora(TRAIN_ARGS)


def _assert_same_lora(
    out: Path,
    ref: Path,
    init: dict[str, torch.Tensor],
    atol: float,
    cosines: bool = True,
    rtol: float = 0.0,
    skip: tuple[str, ...] = (),
) -> None:
    a, b = load_file(str(ref / LORA)), load_file(str(out / LORA))
    assert a.keys() == b.keys() == init.keys()
    moved = max((a[name] - init[name]).abs().max().item() for name in a)
    assert moved > 100 * atol, f"the reference run barely trained (max change {moved:.2e}): the test would be vacuous"
    for name in a:
        assert a[name].shape == b[name].shape, name
        if any(part in name for part in skip):
            continue
        torch.testing.assert_close(b[name], a[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
    # the runs really trained and measured the same steps
    steps, ref_steps = _steps(out), _steps(ref)
    assert [s["step"] for s in steps] == [s["step"] for s in ref_steps] == [1, 2, 3]
    for s, r in zip(steps, ref_steps):
        assert s["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
        assert s.get("marble/refreshes") == r.get("marble/refreshes")
        # by value: the ZeRO-3 run renames the first reward (its probe)
        logged = lambda row: sorted(v for k, v in row.items() if k.startswith("update_cos/"))  # noqa: E731
        if logged(r):  # the amortised step (solved-first refreshes also log the whole step's cosines)
            assert logged(s) == pytest.approx(logged(r), abs=1e-4)
    if cosines:
        assert any(k.startswith("update_cos/") for k in ref_steps[1]), "the cosine diagnostic did not run"
    # the logged loss means the same on every back-end (a solved-first refresh logs the step as planned)
    for s, r in zip(steps, ref_steps):
        assert s["loss"] == pytest.approx(r["loss"], rel=1e-4)


def _plain(out: Path, train_args: list[str]) -> Path:
    """``train_args`` in one process (this one): the reference every launcher must reproduce."""
    from marble_trl.cli import main

    # One intra-op thread, as the launched runs have (OMP_NUM_THREADS=1): the reference is then computed the same
    # way on every machine, whatever its number of cores (thread count can change float summation order).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *train_args, "--output_dir", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    """The tiny recipe in one process (this one): the reference of the SD3 launches."""
    return _plain(tmp_path_factory.mktemp("plain"), TRAIN_ARGS)


@pytest.fixture(scope="module")
def plain_flux(tmp_path_factory) -> Path:
    """The tiny recipe on tiny FLUX.1 in one process: the reference of the multi-node and FSDP2 launches."""
    return _plain(tmp_path_factory.mktemp("plain-flux"), FLUX_ARGS)


@pytest.mark.heavy
@pytest.mark.slow
def test_multi_node_config_two_machines_on_one_host_match_one(plain_flux, tmp_path):
    """The shipped multi-node template as 2 machines x 1 process, both on 127.0.0.1 (static rendezvous, gloo), on
    tiny FLUX.1: the LoRA of one process with gradient accumulation."""
    out = tmp_path / "nodes"
    env = _env(ACCELERATE_USE_CPU="true")

    def launch(port: int, rank: int) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ACCELERATE / "multi_node.yaml"),
        ]
        cmd += ["--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank)]
        cmd += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        cmd += ["-m", "marble_trl.cli", "train", *FLUX_ARGS, "--output_dir", str(out)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    for attempt in range(3):
        port = _free_port()
        nodes = [launch(port, rank) for rank in (0, 1)]
        logs = [node.communicate(timeout=900) for node in nodes]
        codes = [node.returncode for node in nodes]
        if codes == [0, 0] or not any(_PORT_TAKEN.search(err) for _, err in logs) or attempt == 2:
            break
        shutil.rmtree(out, ignore_errors=True)
    assert codes == [0, 0], "\n".join(err[-3000:] for _, err in logs)
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.world_size == 2 and args.gradient_accumulation_steps == 2
    # An all-reduce sums in another order than gradient accumulation; SGD at lr 1 carries that over 3 steps.
    _assert_same_lora(out, plain_flux, _init_lora(FLUX_ARGS), atol=1e-5, rtol=1e-4)


def zero3_config(folder: Path, persistence_threshold: int) -> Path:
    """recipes/accelerate/deepspeed_zero3.yaml in fp32 with its own DeepSpeed file (``folder/zero3.yaml``): weights
    under ``persistence_threshold`` elements stay gathered between forwards (DeepSpeed's default, 1e5, would keep
    every weight of a tiny model whole)."""
    ds_config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": persistence_threshold,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    (folder / "ds.json").write_text(json.dumps(ds_config))
    config = yaml.safe_load((ACCELERATE / "deepspeed_zero3.yaml").read_text())
    config["deepspeed_config"] = {"deepspeed_config_file": str(folder / "ds.json"), "zero3_init_flag": False}
    config.pop("mixed_precision")  # the DeepSpeed file decides (fp32 here)
    (folder / "zero3.yaml").write_text(yaml.safe_dump(config))
    return folder / "zero3.yaml"


def _deepspeed_command(
    config: Path, out: Path, train_args: list[str], processes: int = 1
) -> Callable[[int], list[str]]:
    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        cmd += ["--num_processes", str(processes), "--main_process_port", str(port)]
        return cmd + ["-m", "marble_trl.cli", "train", *train_args, "--output_dir", str(out), "--use_cpu", "false"]

    return command


def _deepspeed_run(config: Path, out: Path, train_args: list[str], processes: int = 1) -> subprocess.CompletedProcess:
    return _run(_deepspeed_command(config, out, train_args, processes), _env(), out)


SAVE_EACH_STEP = ["--save_strategy", "steps", "--save_steps", "1"]
# the CLI's before/after grid: under ZeRO-3 and FSDP2 every process draws it (a forward gathers from every process)
SAMPLE_GRID = ["--sample_grid_prompts", "1", "--sample_grid_seeds", "1"]


def _assert_exact_resume(command: Callable[[int], list[str]], out: Path, env: dict[str, str]) -> None:
    """Resume ``command``'s finished run (saved at every step) from checkpoint-1: steps 2 (amortised: the restored
    alpha_bar) and 3 (a refresh) again, from DeepSpeed's engine checkpoint plus the old policy, the balancer and the
    data position; the final LoRA must be the uninterrupted run's, bit for bit."""
    full = load_file(str(out / LORA))
    (out / LORA).unlink()
    resumed = lambda port: [*command(port), "--resume_from_checkpoint", str(out / "checkpoint-1")]  # noqa: E731
    _run(resumed, env, out)
    again = load_file(str(out / LORA))
    assert full.keys() == again.keys()
    for name in full:
        assert torch.equal(again[name], full[name]), name
    # metrics.jsonl continues from the checkpoint's log history: steps 2 and 3 replaced, not appended twice
    assert [s["step"] for s in _steps(out)] == [1, 2, 3]


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_zero2_two_processes_through_the_wrapper_match_plain_run(plain_run, init_lora, tmp_path):
    """`marble-trl train --accelerate_config deepspeed_zero2.yaml --num_processes 2`: two CPU processes under ZeRO-2
    (gloo: the config picks it for DeepSpeed without CUDA, where accelerate would pick no backend and count each
    process as the only one), each with two micro-batches of the step (GA 2 x T 3 backward calls per optimizer step)."""
    config = yaml.safe_load((ACCELERATE / "deepspeed_zero2.yaml").read_text())
    config_file = tmp_path / "zero2.yaml"
    out = tmp_path / "zero2x2"

    def command(port: int) -> list[str]:
        config_file.write_text(yaml.safe_dump({**config, "main_process_port": port}))
        cmd = [sys.executable, "-m", "marble_trl.cli", "train", *TRAIN_ARGS, "--output_dir", str(out)]
        return cmd + ["--use_cpu", "false", "--accelerate_config", str(config_file), "--num_processes", "2"]

    proc = _run(command, _env(), out)
    assert "accelerate.commands.launch --config_file" in proc.stdout  # the wrapper ran accelerate
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.world_size == 2 and args.gradient_accumulation_steps == 2 and args.ddp_backend == "gloo"
    assert args.marble_refresh_update == "gradient"  # the paper's Eq. 7, solved first (no fallback any more)
    # accelerate reports the DeepSpeed config's accumulation: GA (2) x T (3 timesteps) backward calls per step
    assert "DeepSpeed config has 6" in proc.stderr
    refreshes = [s for s in _steps(out) if "marble/refresh_pairs" in s]
    assert [s["marble/refresh_pairs"] for s in refreshes] == [REFRESH_PAIRS] * 2  # every pair of the step
    _assert_same_lora(out, plain_run, init_lora, atol=1e-5)
    # Exact resume under DeepSpeed: the ZeRO-3 test below (the same engine-checkpoint path, partitioned).


@pytest.fixture(scope="module")
def ddp_qwen_released(tmp_path_factory) -> Path:
    """recipes/accelerate/multi_gpu.yaml, two CPU processes (gloo DDP), tiny Qwen-Image with the released MARBLE. The
    released procedure solves each process's micro-batch of a (micro-batch, timestep) slot together, so its result
    depends on the number of processes (unlike the paper's): two processes are the reference of two processes."""
    out = tmp_path_factory.mktemp("ddp-qwen") / "run"

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE / "multi_gpu.yaml")]
        cmd += ["--num_processes", "2", "--main_process_port", str(port), "-m", "marble_trl.cli", "train"]
        return cmd + [*QWEN_RELEASED_ARGS, "--output_dir", str(out)]

    proc = _run(command, _env(ACCELERATE_USE_CPU="true"), out)
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert args.world_size == 2 and args.gradient_accumulation_steps == 2 and args.marble_procedure == "released"
    # the recipe's targets put a LoRA on the last block's text-stream output, which Qwen-Image discards: found, and
    # DDP told to expect it (else it stalls at step 1 waiting for its gradient)
    assert "never reach the transformer's output (transformer_blocks.1.attn.to_add_out" in proc.stderr
    assert args.ddp_find_unused_parameters
    return out


@pytest.mark.heavy
@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_zero3_partitioned_over_two_processes_matches_ddp(ddp_qwen_released, tmp_path):
    """Tiny Qwen-Image (its Qwen2.5-VL text encoder built outside ZeRO-3's partitioning) with the released MARBLE:
    per-pair per-reward gradients outside DeepSpeed, each solved pair's update through DeepSpeed's backward; DDP's
    LoRA on the same two processes (recipes/accelerate/multi_gpu.yaml), and an exact resume."""
    # every parameter partitioned over the two ranks (the default persistence threshold would keep the tiny model's
    # params whole)
    zero3_config(tmp_path, persistence_threshold=0)
    # The recipe's brightness reward, wrapped to fail if a reward would load its model under deepspeed.zero.Init (as
    # transformers does while a ZeRO-3 config is registered): reward models load lazily, in the middle of training.
    (tmp_path / "zero3_probe.py").write_text(
        "from transformers.integrations import is_deepspeed_zero3_enabled\n"
        "from marble_trl.rewards.simple import brightness\n\n\n"
        "def probe(prompts, images, **columns):\n"
        "    assert not is_deepspeed_zero3_enabled(), 'a reward model would be built partitioned'\n"
        "    return brightness(prompts, images, **columns)\n"
    )
    out = tmp_path / "zero3"
    rewards = ["--reward_funcs", "zero3_probe:probe", "contrast"]
    train_args = [*QWEN_RELEASED_ARGS, *rewards, *SAVE_EACH_STEP, *SAMPLE_GRID]
    command = _deepspeed_command(tmp_path / "zero3.yaml", out, train_args, processes=2)
    env = _env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    _run(command, env, out)
    assert (out / "samples_before_after.png").is_file()  # drawn by both processes
    # The recipe's LoRA on the last block's text-stream output (attn.to_add_out) never reaches Qwen-Image's output (the
    # model discards that stream): DDP runs with find_unused_parameters and hands the optimizer a zero gradient for it,
    # so weight decay shrinks its lora_A there, while DeepSpeed leaves it; lora_B stays 0 in both (it cannot train).
    unreached = ("transformer_blocks.1.attn.to_add_out.lora_A",)
    _assert_same_lora(out, ddp_qwen_released, _init_lora(QWEN_RELEASED_ARGS), atol=1e-5, cosines=False, skip=unreached)
    solved = [s["marble/refreshes"] for s in _steps(out)]
    assert solved == [6.0, 6.0, 7.0]  # every pair of step 0 (GA 2 x T 3 on each process), the first pair of step 2
    _assert_exact_resume(command, out, env)


@pytest.mark.slow
def test_fsdp2_two_processes_match_plain_run_and_resume_exactly(plain_flux, tmp_path):
    """recipes/accelerate/fsdp2.yaml over two CPU processes (gloo; tests/dist/fsdp_cpu.py lets accelerate choose FSDP
    on a CPU): every LoRA weight a DTensor shard, the per-reward gradients from layer inputs and output gradients (the
    weights stay sharded), MARBLE's exact Eq. 7 added to the sharded ``.grad``, the cosine diagnostic on the gathered
    gradient, the parameter EMA, the sample grid drawn by both processes, the recipe's root-level ``proj_out`` LoRA
    as an FSDP unit of its own, on tiny FLUX.1 (its dual- and single-stream blocks each an FSDP unit); the plain run's
    LoRA, the same
    coefficients on both processes, and a run resumed from checkpoint-1 (the optimizer's sharded state, no copy of the
    frozen transformer) ends bit for bit where it ended."""
    out = tmp_path / "fsdp2"

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE / "fsdp2.yaml")]
        cmd += ["--num_processes", "2", "--main_process_port", str(port), str(ROOT / "tests" / "dist" / "fsdp_cpu.py")]
        cmd += ["train", *FLUX_ARGS, *SAVE_EACH_STEP, "--param_ema", "true", *SAMPLE_GRID]
        return cmd + ["--output_dir", str(out)]

    env = _env(ACCELERATE_USE_CPU="true")
    _run(command, env, out)
    assert (out / "samples_before_after.png").is_file()  # drawn by both processes (each forward needs both)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for state in ranks:
        assert state["distributed_type"] == "DistributedType.FSDP"
        assert state["sharded"] == state["params"] > 0  # every LoRA weight is a DTensor
        assert state["proj_out_unit"]  # the LoRA layer outside the blocks is a unit of its own, not the root's
    assert ranks[0]["local_numel"] + ranks[1]["local_numel"] == ranks[0]["numel"]  # the shards partition the LoRA
    assert 0 < ranks[1]["local_numel"] < ranks[0]["numel"]
    assert ranks[0]["balancer"] == ranks[1]["balancer"] and ranks[0]["balancer"]["num_refreshes"] == 2
    assert not (out / "checkpoint-1" / "pytorch_model_fsdp_0").exists()  # the frozen transformer is not copied
    assert (out / "checkpoint-1" / "optimizer_0").is_dir()
    _assert_same_lora(out, plain_flux, _init_lora(FLUX_ARGS), atol=1e-5, rtol=1e-4)
    _assert_exact_resume(command, out, env)


def test_gradient_checkpointing_reaches_the_diffusers_transformer(tmp_path):
    """`gradient_checkpointing: true` -> the Trainer's `activation_checkpointing_enable` -> diffusers' own switch
    (the same call path with every launcher: it runs before the model is wrapped)."""
    from marble_trl import MarbleDiffusionNFTConfig, MarbleDiffusionNFTTrainer
    from marble_trl.data.prompts import load_prompt_dataset

    args = MarbleDiffusionNFTConfig(
        output_dir=str(tmp_path),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        prompts_per_step=1,
        resolution=32,
        num_sample_steps=2,
        sample_scheduler="euler",
        max_sequence_length=8,
        lora_r=2,
        lora_alpha=4,
        use_cpu=True,
        gradient_checkpointing=True,
    )
    trainer = MarbleDiffusionNFTTrainer("tiny", "brightness", args=args, train_dataset=load_prompt_dataset())
    assert not trainer.transformer.is_gradient_checkpointing
    trainer.train()
    assert trainer.transformer.is_gradient_checkpointing


def test_launch_retries_when_its_port_is_taken(tmp_path, monkeypatch):
    """`_free_port` cannot reserve the port it returns: a launch that finds it taken is retried on another one."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ports = iter([port])
    real = _free_port
    monkeypatch.setattr(sys.modules[__name__], "_free_port", lambda: next(ports, None) or real())
    out, tried = tmp_path / "out", []
    bind = (
        "import socket, sys, pathlib; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); "
        "pathlib.Path(sys.argv[2]).mkdir(); pathlib.Path(sys.argv[2], sys.argv[3]).write_text('x')"
    )

    def command(port: int) -> list[str]:
        tried.append(port)
        return [sys.executable, "-c", bind, str(port), str(out), LORA]

    with taken:
        _run(command, dict(os.environ), out)
    assert len(tried) == 2 and tried[0] == port != tried[1]


@pytest.mark.heavy
@pytest.mark.slow
def test_single_gpu_config_runs_the_recipe_as_one_plain_process(tmp_path):
    """recipes/accelerate/single_gpu.yaml through the CLI's launcher wrapper, on tiny Z-Image (on a CPU machine: one
    process, no device): bit for bit the run of the same recipe without a launcher."""
    args = [*TRAIN_ARGS, "--model_name_or_path", "tiny-z-image", "--lora_target_modules", "to_q", "to_k", "to_v"]
    plain = _plain(tmp_path / "plain", args)
    out = tmp_path / "launched"

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "marble_trl.cli", "train", *args, "--output_dir", str(out)]
        return cmd + ["--accelerate_config", str(ACCELERATE / "single_gpu.yaml")]

    proc = _run(command, _env(), out)
    assert "accelerate.commands.launch --config_file" in proc.stdout
    a, b = load_file(str(plain / LORA)), load_file(str(out / LORA))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
