"""Worker for the multi-process resume tests: python resume_run.py OUT_DIR stop|fail|resume (torchrun, 2 processes).

``stop``: the small 6-step MARBLE run of tests/marble_runs.py (one micro-batch of 4 per process); rank 1 alone
receives SIGTERM after step 3, so both ranks must agree to stop and checkpoint. ``resume``: resume from the last
checkpoint to step 6. ``fail``: rank 1's second reward raises in step 4 (a reward server down on one rank): every
rank must stop there together and write the emergency checkpoint of step 3. Each rank dumps the prompts it scored per step, its LoRA, balancer and stop reason.
"""

import os
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from marble_runs import REWARDS, make_trainer, recording  # noqa: E402


class SigtermRank1(TrainerCallback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3 and self.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def failing_at_call(reward, call: int):
    calls = []

    def flaky(prompts, images, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise ConnectionError("reward server down (rank 1 only)")
        return reward(prompts, images, **kwargs)

    flaky.__name__ = reward.__name__
    return flaky


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    seen: list = []
    callbacks = [SigtermRank1(rank)] if mode == "stop" else None
    rewards = recording(REWARDS, seen)
    if mode == "fail" and rank == 1:
        rewards[1] = failing_at_call(rewards[1], 4)
    trainer = make_trainer(out, rewards=rewards, callbacks=callbacks)
    error = None
    try:
        trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    except Exception as e:  # recorded for the test, which checks how each rank failed
        error = e
    state = {
        "prompts": seen,
        "lora": {n: p.detach().cpu().clone() for n, p in trainer.trainable_parameters().items()},
        "balancer": trainer.balancer.state_dict(),
        "stopped_by": trainer.stopped_by_signal,
        "global_step": trainer.state.global_step,
        "world": trainer.accelerator.num_processes,
        "rewards": [h["rewards/brightness/mean"] for h in trainer.state.log_history if "loss" in h],
        "error": None if error is None else (type(error).__name__, getattr(error, "all_processes", False)),
        "emergency_checkpoint": getattr(trainer, "emergency_checkpoint", None),
    }
    torch.save(state, f"{out}/{mode}-rank{rank}.pt")
    torch.distributed.destroy_process_group()  # a clean exit (gloo may abort at interpreter exit otherwise)


if __name__ == "__main__":
    main()
