"""Worker for the multi-process resume test: python resume_run.py OUT_DIR stop|resume (under torchrun, 2 processes).

``stop``: the small 6-step MARBLE run of tests/marble_runs.py (one micro-batch of 4 per process); rank 1 alone
receives SIGTERM after step 3, so both ranks must agree to stop and checkpoint. ``resume``: resume from the last
checkpoint to step 6. Each rank dumps the prompts it scored per step, its LoRA, balancer and stop reason.
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


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    seen: list = []
    callbacks = [SigtermRank1(rank)] if mode == "stop" else None
    trainer = make_trainer(out, rewards=recording(REWARDS, seen), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    state = {
        "prompts": seen,
        "lora": {n: p.detach().cpu().clone() for n, p in trainer.trainable_parameters().items()},
        "balancer": trainer.balancer.state_dict(),
        "stopped_by": trainer.stopped_by_signal,
        "global_step": trainer.state.global_step,
        "world": trainer.accelerator.num_processes,
        "rewards": [h["rewards/brightness/mean"] for h in trainer.state.log_history if "loss" in h],
    }
    torch.save(state, f"{out}/{mode}-rank{rank}.pt")
    torch.distributed.destroy_process_group()  # a clean exit (gloo may abort at interpreter exit otherwise)


if __name__ == "__main__":
    main()
