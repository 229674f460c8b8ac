"""The chaos soak: a tiny MARBLE run killed with SIGKILL at random moments and resumed each time must end bit for bit
where the uninterrupted run ends (docs/checkpoints.md, "Faults and what survives them").

A seeded schedule picks the moments: a phase (inside the rollouts, a reward call, a MARBLE refresh, just before the
optimizer step, inside a checkpoint save, an evaluation) and a step of the run
(``tests/dist/chaos_child.py`` stops at the first call of the phase once the run has completed that many steps,
and this script SIGKILLs it and every process below it). After each kill the run
restarts with ``--resume_from_checkpoint true`` (the newest valid checkpoint). The final checkpoint's trained LoRA,
old policy, parameter EMA, optimizer and scheduler states and MARBLE balancer state are compared with the
uninterrupted run's, tensor by tensor (``torch.equal``); the figure is the kills survived and the differing tensors.

    python benchmarks/chaos_soak.py                              # 200 steps, 10 kills, one process
    python benchmarks/chaos_soak.py --processes 2                # two CPU processes (DDP, gloo)
    python benchmarks/chaos_soak.py --accelerate-config recipes/accelerate/deepspeed_zero2.yaml --processes 2
    python benchmarks/chaos_soak.py --seed 3                     # another schedule; a failure replays with its seed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "dist" / "chaos_child.py"
PHASES = ("rollout", "reward", "refresh", "optimizer", "save", "eval")


def train_args(out: Path, steps: int, save_steps: int, eval_steps: int) -> list[str]:
    """The soaked run: the tiny recipe with MARBLE (a refresh every 3 steps), the parameter EMA, AdamW, checkpoints
    every ``save_steps`` steps and an evaluation every ``eval_steps``."""
    return [
        "train", "--config", str(ROOT / "recipes" / "tiny-random.yaml"), "--output_dir", str(out),
        "--max_steps", str(steps), "--reward_funcs", "brightness", "contrast", "--marble_refresh_interval", "3",
        "--param_ema", "true", "--save_strategy", "steps", "--save_steps", str(save_steps), "--save_total_limit", "2",
        "--eval_dataset_name", "bundled", "--eval_strategy", "steps", "--eval_steps", str(eval_steps),
        "--eval_num_sample_steps", "2", "--eval_num_images_per_prompt", "1", "--sample_grid_prompts", "0",
        "--num_generations", "4", "--per_device_train_batch_size", "4", "--resolution", "16",
        "--num_sample_steps", "2", "--disable_tqdm", "true", "--overwrite_output_dir", "false",
        "--learning_rate", "1e-2",
    ]  # fmt: skip


def command(args: list[str], processes: int, accelerate_config: str | None) -> list[str]:
    if processes == 1 and accelerate_config is None:
        return [sys.executable, str(CHILD), *args]
    config = accelerate_config or str(ROOT / "recipes" / "accelerate" / "multi_gpu.yaml")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
    launch += ["--num_processes", str(processes), "--main_process_port", str(_free_port())]
    extra = ["--use_cpu", "false"] if "deepspeed" in config else []
    return [*launch, str(CHILD), *args, *extra]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(processes: int, accelerate_config: str | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if processes > 1 and not (accelerate_config and "deepspeed" in accelerate_config):
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): torchrun starts its workers in sessions of their own, so killing the
    launcher's process group would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (the tree is read first, so nothing is orphaned unseen)."""
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def run_until(cmd: list[str], env: dict[str, str], marker: Path, kill: tuple[str, int] | None, timeout: float) -> str:
    """Run ``cmd``; with ``kill``, SIGKILL it and its descendants once it reaches that moment. Returns "killed at ...",
    "finished" or raises on a failure that is not a kill."""
    marker.unlink(missing_ok=True)
    log = marker.with_name(f"launch-{len(list(marker.parent.glob('launch-*.log')))}.log")
    env = dict(env)
    if kill is not None:
        env.update(MARBLE_CHAOS=f"{kill[0]}:{kill[1]}", MARBLE_CHAOS_MARKER=str(marker))
    with open(log, "wb") as out:  # the whole output of each launch stays beside the marker for a post-mortem
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if marker.is_file():
            kill_tree(proc.pid)
            time.sleep(0.1)  # the marker's text is written right after it is created
            proc.wait()
            return f"killed at {marker.read_text()}"
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            raise TimeoutError(f"{cmd} ran past {timeout} s")
        time.sleep(0.05)
    if proc.returncode != 0:
        output = log.read_text(errors="replace")
        raise RuntimeError(f"exit {proc.returncode} (whole output: {log}):\n{output[-4000:]}")
    return "finished"


def schedule(seed: int, kills: int, steps: int, margin: int = 10, phases=PHASES) -> list[tuple[str, int]]:
    """``kills`` (phase, step) moments at increasing steps spread over the run (each run resumes at most
    ``save_steps`` back), every phase at least once when there are enough kills (seeded). ``margin``: no kill in
    the last steps, where a save or an evaluation might not come any more."""
    rng = random.Random(seed)
    picks = list(phases) * (kills // len(phases)) + rng.sample(list(phases), kills % len(phases))
    rng.shuffle(picks)
    at = sorted(rng.sample(range(1, max(2, steps - margin)), kills))
    return list(zip(picks, at))


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(f"{prefix}.{index}", item, out)
    elif hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, type)):  # e.g. DeepSpeed's loss scaler
        _flatten(f"{prefix}.{type(value).__name__}", vars(value), out)
    else:
        out[prefix] = value


def final_state(folder: Path) -> dict[str, object]:
    """Every tensor and value of a checkpoint, by file: the adapters, the EMA, the optimizer and scheduler states
    (the Trainer's ``optimizer.pt`` or DeepSpeed's partitioned files under ``global_step*/``), the RNG states and the
    balancer state."""
    from safetensors.torch import load_file

    state: dict[str, object] = {}
    for name in ("pytorch_lora_weights.safetensors", "old_policy_lora.safetensors", "param_ema.safetensors"):
        for key, value in load_file(str(folder / name)).items():
            state[f"{name}:{key}"] = value
    for path in sorted(folder.rglob("*.pt*")):
        _flatten(str(path.relative_to(folder)), torch.load(path, map_location="cpu", weights_only=False), state)
    state["balancer"] = json.loads((folder / "marble_balancer.json").read_text())
    return state


def final_lora(folder: Path) -> dict[str, object]:
    """The run's exported LoRA (``output_dir/pytorch_lora_weights.safetensors``)."""
    from safetensors.torch import load_file

    return {f"final:{k}": v for k, v in load_file(str(folder / "pytorch_lora_weights.safetensors")).items()}


def differences(a: dict[str, object], b: dict[str, object]) -> list[str]:
    out = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        elif type(x).__module__ == "numpy":  # NumPy's RNG state
            import numpy as np

            same = bool(np.array_equal(x, y))
        else:
            same = x == y
        if not same:
            out.append(key)
    return out


def soak(root: Path, steps: int, kills: int, seed: int, processes: int = 1, accelerate_config: str | None = None,
         save_steps: int = 5, eval_steps: int = 10, timeout: float = 900.0,
         plan: list[tuple[str, int]] | None = None) -> dict[str, object]:  # fmt: skip
    """The uninterrupted run and the killed-and-resumed one under ``root``; returns the figure. ``plan``: the kills
    (phase, n) instead of the seeded schedule."""
    env = _env(processes, accelerate_config)
    reference, chaos = root / "reference", root / "chaos"
    run_until(command(train_args(reference, steps, save_steps, eval_steps), processes, accelerate_config), env,
              root / "marker", None, timeout)  # fmt: skip
    events = []
    for kill in plan if plan is not None else schedule(seed, kills, steps, max(save_steps, eval_steps)):
        args = train_args(chaos, steps, save_steps, eval_steps)
        if any(chaos.glob("checkpoint-*")):
            args += ["--resume_from_checkpoint", "true"]
        events.append(
            (kill, run_until(command(args, processes, accelerate_config), env, root / "marker", kill, timeout))
        )
    args = [*train_args(chaos, steps, save_steps, eval_steps), "--resume_from_checkpoint", "true"]
    run_until(command(args, processes, accelerate_config), env, root / "marker", None, timeout)
    last = f"checkpoint-{steps}"
    diff = differences(final_state(reference / last), final_state(chaos / last))
    diff += differences(final_lora(reference), final_lora(chaos))
    killed = [e for e in events if e[1].startswith("killed")]
    return {"kills": len(killed), "planned": len(events), "events": events, "differing": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--accelerate-config", default=None)
    parser.add_argument("--out", default="outputs/chaos-soak")
    args = parser.parse_args()
    import shutil

    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    start = time.perf_counter()
    figure = soak(root, args.steps, args.kills, args.seed, args.processes, args.accelerate_config)
    for (phase, n), outcome in figure["events"]:
        print(f"  kill at {phase} after step {n}: {outcome}")
    print(
        f"{figure['kills']} of {figure['planned']} kills survived ({args.steps} steps, {args.processes} process(es), "
        f"seed {args.seed}); tensors differing from the uninterrupted run: {len(figure['differing'])} "
        f"{figure['differing'][:5]}; {time.perf_counter() - start:.0f} s"
    )
    sys.exit(1 if figure["differing"] else 0)


if __name__ == "__main__":
    main()
