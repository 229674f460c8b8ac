"""``marble-trl train`` that stops itself at a chosen moment so that its parent SIGKILLs it there (the chaos soak).

``MARBLE_CHAOS="phase:n"``: at the n-th call (1-based, in this process) of ``phase`` the process writes
``MARBLE_CHAOS_MARKER`` and waits; the parent, polling for the marker, kills the whole process group with SIGKILL.
Phases: ``rollout`` (the step's sampling), ``reward`` (the reward call), ``refresh`` (MARBLE's QP at a refresh),
``optimizer`` (just before the optimizer step), ``save`` (inside a checkpoint save, after the Trainer's files, before
the manifest), ``eval`` (an evaluation). Without ``MARBLE_CHAOS`` it is plain ``marble-trl train``.

    python chaos_child.py train --config ... (the CLI's arguments)
"""

import os
import sys
import time


def _install() -> None:
    spec = os.environ.get("MARBLE_CHAOS")
    if not spec:
        return
    phase, n = spec.split(":")
    n = int(n)
    marker = os.environ["MARBLE_CHAOS_MARKER"]
    calls: dict[str, int] = {}

    def hit(name: str) -> None:
        calls[name] = calls.get(name, 0) + 1
        if name == phase and calls[name] == n:
            with open(marker, "w") as f:
                f.write(f"{name}:{n}:{os.getpid()}")
            while True:  # the parent kills the process group
                time.sleep(1)

    def wrap(owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            hit(name)
            return original(*args, **kwargs)

        setattr(owner, attr, wrapped)

    import marble_trl.balance.marble as marble
    import marble_trl.balance.released as released
    import marble_trl.guards as guards
    import marble_trl.trainer.checkpointing as checkpointing
    import marble_trl.trainer.trainer as trainer

    wrap(trainer, "rollouts", "rollout")
    wrap(trainer, "score_rewards", "reward")
    wrap(marble.MarbleBalancer, "refresh", "refresh")
    wrap(released.ReleasedMarble, "solve", "refresh")
    wrap(guards.NonFiniteGuard, "on_pre_optimizer_step", "optimizer")
    wrap(checkpointing, "save_training_state", "save")
    wrap(trainer.MarbleDiffusionNFTTrainer, "evaluate", "eval")


if __name__ == "__main__":
    _install()
    from marble_trl.cli import main

    sys.exit(main(sys.argv[1:]))
