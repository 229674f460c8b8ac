"""Prompt datasets and the group sampler.

The trainer reads a :class:`datasets.Dataset` with a ``prompt`` column; every other column is passed to the reward
functions. :class:`GroupSampler` repeats each prompt ``num_generations`` times in a row (one group), like TRL GRPO's
``RepeatSampler``, and yields only whole optimizer steps of ``prompts_per_step`` groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import Sampler

BUNDLED_PROMPTS = "tiny_prompts.txt"


def bundled_prompts_path() -> Path:
    """Path of the prompt file shipped with the package (used by the tiny CPU recipe)."""
    return Path(str(resources.files("marble_trl") / "data" / BUNDLED_PROMPTS))


def load_prompt_dataset(path: str | None = None):
    """A ``datasets.Dataset`` with a ``prompt`` column from a text file (one prompt per line; blank lines and
    ``#`` comments skipped). ``None`` or ``"bundled"`` loads the packaged tiny prompt file."""
    from datasets import Dataset

    file = bundled_prompts_path() if path in (None, "bundled") else Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"Prompt file {str(file)!r} does not exist (dataset_name / prompt file).")
    prompts = [ln.strip() for ln in file.read_text(encoding="utf-8").splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise ValueError(f"Prompt file {str(file)!r} holds no prompt.")
    return Dataset.from_dict({"prompt": prompts})


def check_prompt_dataset(dataset, name: str = "train_dataset") -> None:
    """Clear errors for datasets the trainer cannot use."""
    if dataset is None:
        raise ValueError(f"{name} is required: a datasets.Dataset with a 'prompt' column.")
    if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
        raise TypeError(f"{name} must be a datasets.Dataset (with a 'prompt' column), got {type(dataset).__name__}.")
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: it needs at least one prompt.")
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {dataset.column_names}); rename your text column with "
            "dataset.rename_column(<name>, 'prompt')."
        )


class GroupSampler(Sampler[int]):
    """Yields dataset indices so that every prompt appears ``num_generations`` times in a row.

    One epoch is a seeded permutation of the dataset cut into whole steps of ``prompts_per_step`` prompts (a
    dataset smaller than one step is cycled). Every process uses the same seed, so the global order is identical
    everywhere and accelerate can shard it.
    """

    def __init__(self, num_prompts: int, num_generations: int, prompts_per_step: int, seed: int = 0) -> None:
        self.num_prompts = num_prompts
        self.num_generations = num_generations
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _steps(self) -> int:
        return max(1, self.num_prompts // self.prompts_per_step)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        needed = self._steps() * self.prompts_per_step
        order: list[int] = []
        while len(order) < needed:
            order.extend(torch.randperm(self.num_prompts, generator=g).tolist())
        for idx in order[:needed]:
            yield from [idx] * self.num_generations

    def __len__(self) -> int:
        return self._steps() * self.prompts_per_step * self.num_generations
