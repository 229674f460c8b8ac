"""Concrete fixes for a run that does not fit its GPU: the memory savers the config has (docs/distributed.md,
"Memory savers"), a smaller micro-batch that keeps the batching valid (the trainer's own arithmetic), a sharding
strategy, each re-estimated; the fewest that fit, best first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from .memory import GIB, MemoryInputs, Strategy, estimate_memory

MIN_SAVING = 0.25 * GIB  # a fix that saves less is not worth listing
ACCELERATE_CONFIGS = {"zero3": "recipes/accelerate/deepspeed_zero3.yaml", "fsdp2": "recipes/accelerate/fsdp2.yaml"}


@dataclass(frozen=True)
class Fix:
    text: str
    inputs: MemoryInputs


def valid_micro_batches(args, processes: int, check_batching: Callable, upto: int | None = None) -> list[int]:
    """Every ``per_device_train_batch_size`` from 1 to ``upto`` (default: below the current one) that the trainer's
    batching check (:func:`marble_trl.config_checks.check_batching`) accepts on ``processes`` processes with the
    run's ``prompts_per_step`` and ``num_generations``."""
    upto = args.per_device_train_batch_size - 1 if upto is None else upto
    out = []
    for m in range(1, upto + 1):
        trial = SimpleNamespace(
            prompts_per_step=args.prompts_per_step, num_generations=args.num_generations, world_size=processes,
            per_device_train_batch_size=m, gradient_accumulation_steps=args.gradient_accumulation_steps,
        )  # fmt: skip
        try:
            check_batching(trial)
        except ValueError:
            continue
        out.append(m)
    return out


def candidates(m: MemoryInputs, micro_batches: list[int], rewards_on_gpu: list[str], capacity: float) -> list[Fix]:
    out = []
    if not m.checkpointing and m.act_checkpointed is not None:
        out.append(Fix("add --activation_checkpointing true", m.replace(checkpointing=True)))
    if m.text_resident:
        out.append(
            Fix(
                "add --offload_text_encoders true (or --cache_prompt_embeddings true for a prompt set that fits in "
                "host RAM)",
                m.replace(text_resident=False),
            )
        )
    if m.rewards_resident:
        names = ", ".join(f"reward_kwargs.{n}.offload: true" for n in rewards_on_gpu)
        out.append(
            Fix(
                f"offload the reward models between scoring calls ({names}; or device: cpu)",
                m.replace(rewards_resident=0, rewards_visiting=m.rewards_visiting + m.rewards_resident),
            )
        )
    s = m.strategy
    # full fine-tuning: sharded weights only where MARBLE takes layer_gram (or no per-reward gradient)
    kinds = ("zero3", "fsdp2") if not (m.per_reward_gradients and not m.layer_gram) else ()
    if s.processes > 1 and not s.shards_weights:
        for kind in kinds if m.full else ("zero3", "fsdp2"):
            out.append(
                Fix(
                    f"use {ACCELERATE_CONFIGS[kind]} (--accelerate_config {ACCELERATE_CONFIGS[kind]}: shards the "
                    f"transformer over the {s.processes} GPUs)",
                    m.replace(strategy=Strategy(kind, s.processes, source=ACCELERATE_CONFIGS[kind])),
                )
            )
    if m.moment_bytes > 2:
        out.append(Fix('add --optim adamw_8bit (pip install "marble-trl[bnb]")', m.replace(moment_bytes=2)))
    smaller = sorted((b for b in micro_batches if b < m.micro_batch), reverse=True)
    if smaller and m.activation_per_sample:
        fitting = [b for b in smaller if estimate_memory(m.replace(micro_batch=b)).need <= capacity]
        b = fitting[0] if fitting else smaller[-1]
        out.append(Fix(f"lower per_device_train_batch_size to {b} (--per_device_train_batch_size {b})",
                       m.replace(micro_batch=b)))  # fmt: skip
    return out


def plan_fixes(
    m: MemoryInputs, capacity: float, micro_batches: list[int], rewards_on_gpu: list[str]
) -> tuple[list[str], float, bool]:
    """Greedy: add the fix that lowers the need most until the run fits (or nothing helps). Returns the fixes (each
    with the need after it), the final need, and whether it fits."""
    chosen: list[str] = []
    current = m
    need = estimate_memory(current).need
    used: set[str] = set()
    while need > capacity:
        options = [
            f
            for f in candidates(current, micro_batches, rewards_on_gpu, capacity)
            if f.text.split(" (")[0] not in used
        ]
        scored = sorted(options, key=lambda f: estimate_memory(f.inputs).need)
        if not scored or estimate_memory(scored[0].inputs).need > need - MIN_SAVING:
            break
        best = scored[0]
        used.add(best.text.split(" (")[0])
        if best.text.startswith("use recipes/accelerate/"):
            used.update(f"use {c}" for c in ACCELERATE_CONFIGS.values())
        current, need = best.inputs, estimate_memory(best.inputs).need
        chosen.append(f"{best.text} -> {need / GIB:.1f} GiB needed")
    return chosen, need, need <= capacity
