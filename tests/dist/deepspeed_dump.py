"""``marble-trl`` under DeepSpeed, for the tests: python -m accelerate.commands.launch --config_file <zero3.yaml>
--num_processes 2 tests/dist/deepspeed_dump.py train ARGS...

Runs the CLI unchanged; after training each process writes ``<output_dir>/rank<R>.json``: how many trained weights
are ZeRO-3 partitions and how many of them persist gathered between forwards, the sizes of the full fine-tune's
old-policy and EMA copies as this process holds them against the weights' own, and its balancer state.
"""

import sys


def _describe(trainer) -> dict:
    params = trainer.trainable_parameters()
    policy, ema = trainer.full_policy, trainer.param_ema
    return {
        "params": len(params),
        "zero3": sum(hasattr(p, "ds_tensor") for p in params.values()),
        "persistent": sum(bool(getattr(p, "ds_persist", False)) for p in params.values()),
        "numel": sum(getattr(p, "ds_numel", p.numel()) for p in params.values()),
        "old_numel": sum(t.numel() for t in policy.old.values()) if policy is not None else None,
        "ema_numel": sum(t.numel() for t in ema.shadow.values()) if ema is not None else None,
    }


if __name__ == "__main__":
    from rank_dump import dump_after_training

    from marble_trl.cli import main

    dump_after_training(_describe)
    sys.exit(main(sys.argv[1:]))
