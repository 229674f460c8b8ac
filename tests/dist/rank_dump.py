"""After ``train()``, each process writes ``<output_dir>/rank<R>.json``: what ``describe(trainer)`` returns, plus the
balancer's state (for the launcher shims fsdp_cpu.py and deepspeed_dump.py, which run the CLI unchanged)."""

import json
from collections.abc import Callable
from pathlib import Path


def dump_after_training(describe: Callable[[object], dict]) -> None:
    from marble_trl import MarbleDiffusionNFTTrainer

    train = MarbleDiffusionNFTTrainer.train

    def train_and_dump(self, *args, **kwargs):
        result = train(self, *args, **kwargs)
        state = {**describe(self), "balancer": self.balancer.state_dict() if self.balancer is not None else None}
        Path(self.args.output_dir, f"rank{self.accelerator.process_index}.json").write_text(json.dumps(state))
        return result

    MarbleDiffusionNFTTrainer.train = train_and_dump
