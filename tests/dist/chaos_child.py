"""``marble-trl train`` that stops itself at a chosen moment so that its parent SIGKILLs it there (the chaos soak).

``MARBLE_CHAOS="phase:step"``: at the first call of ``phase`` once the run has completed ``step`` optimizer steps
(``trainer.state.global_step``; the steps of the resumed checkpoint count) the process writes ``MARBLE_CHAOS_MARKER``
and waits; the parent, polling for the marker, SIGKILLs the launch and every process below it.
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
    phase, step = spec.split(":")
    step = int(step)
    marker = os.environ["MARBLE_CHAOS_MARKER"]
    trainers = []

    def hit(name: str) -> None:
        now = trainers[-1].state.global_step if trainers else -1
        if name == phase and now >= step:
            with open(marker, "w") as f:
                f.write(f"{name} after step {now} (pid {os.getpid()})")
            while True:  # the parent kills this process
                time.sleep(1)

    def wrap(owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            hit(name)
            return original(*args, **kwargs)

        setattr(owner, attr, wrapped)

    import marble_trl.balance.marble as marble
    import marble_trl.balance.released as released
    import marble_trl.trainer.guards as guards
    import marble_trl.trainer.checkpointing as checkpointing
    import marble_trl.trainer.rollouts as rollout_hooks
    import marble_trl.trainer.trainer as trainer

    init = trainer.MarbleDiffusionNFTTrainer.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        trainers.append(self)

    trainer.MarbleDiffusionNFTTrainer.__init__ = keep
    wrap(rollout_hooks, "rollouts", "rollout")
    wrap(rollout_hooks, "score_rewards", "reward")
    wrap(marble.MarbleBalancer, "refresh", "refresh")
    wrap(released.ReleasedMarble, "solve", "refresh")
    wrap(guards.NonFiniteGuard, "on_pre_optimizer_step", "optimizer")
    wrap(checkpointing, "save_training_state", "save")
    wrap(trainer.MarbleDiffusionNFTTrainer, "evaluate", "eval")


if __name__ == "__main__":
    _install()
    from marble_trl.cli import main

    sys.exit(main(sys.argv[1:]))
