"""Prompt datasets and the group sampler.

The trainer reads a :class:`datasets.Dataset` with a ``prompt`` column; every other column is passed to the reward
functions. :class:`GroupSampler` repeats each prompt ``num_generations`` times in a row (one group), like TRL GRPO's
``RepeatSampler``, and yields only whole optimizer steps of ``prompts_per_step`` groups. With several prompt sources
(a ``source`` column, see :mod:`marble_trl.sources`) and sampling ratios, it draws each step's prompts per source by
ratio.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import Sampler

from .seeding import keyed_generator

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

    With ``sources`` (each row's source index) and ``ratios`` (each source's share, normalised), every step draws
    ``ratio_k * prompts_per_step`` prompts from source ``k``, rounded by systematic sampling (one seeded uniform
    offset per step: the counts are the floor or the ceiling, their expectation is exact, they sum to
    ``prompts_per_step``), in a seeded random order. Each source's prompts come from its own seeded permutations,
    cycled when the source is used up. An epoch still has ``len(dataset) // prompts_per_step`` steps. A group is one
    prompt, so a group never mixes sources.
    """

    def __init__(
        self,
        num_prompts: int,
        num_generations: int,
        prompts_per_step: int,
        seed: int = 0,
        sources: Sequence[int] | None = None,
        ratios: Sequence[float] | None = None,
    ) -> None:
        self.num_prompts = num_prompts
        self.num_generations = num_generations
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.epoch = 0
        self.rows_by_source: list[list[int]] | None = None
        self.ratios: list[float] | None = None
        if (sources is None) != (ratios is None):
            raise ValueError(
                "GroupSampler needs both sources (one index per row) and ratios (one per source), or neither."
            )
        if sources is not None:
            if len(sources) != num_prompts:
                raise ValueError(f"sources has {len(sources)} entries for {num_prompts} prompts.")
            ratios = [float(r) for r in ratios]
            total = sum(ratios)
            if not all(math.isfinite(r) and r >= 0 for r in ratios) or total <= 0:
                raise ValueError(f"Source ratios must be finite, >= 0 and sum to a positive number, got {ratios}.")
            rows: list[list[int]] = [[] for _ in ratios]
            for row, k in enumerate(sources):
                if not 0 <= k < len(ratios):
                    raise ValueError(f"Row {row} has source index {k}, but there are {len(ratios)} ratios.")
                rows[k].append(row)
            empty = [k for k, r in enumerate(ratios) if r > 0 and not rows[k]]
            if empty:
                raise ValueError(f"Sources {empty} have a ratio > 0 but no rows.")
            self.rows_by_source = rows
            self.ratios = [r / total for r in ratios]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _steps(self) -> int:
        return max(1, self.num_prompts // self.prompts_per_step)

    def __iter__(self) -> Iterator[int]:
        order = self._mixed_order() if self.rows_by_source is not None else self._uniform_order()
        for idx in order:
            yield from [idx] * self.num_generations

    def _uniform_order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        needed = self._steps() * self.prompts_per_step
        order: list[int] = []
        while len(order) < needed:
            order.extend(torch.randperm(self.num_prompts, generator=g).tolist())
        return order[:needed]

    def _mixed_order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        pps = self.prompts_per_step
        cumulative, acc = [], 0.0
        for r in self.ratios:
            acc += r * pps
            cumulative.append(acc)
        cumulative[-1] = float(pps)  # exact total, whatever the rounding of the ratios
        streams = [self._source_stream(k) for k in range(len(self.ratios))]
        order: list[int] = []
        for _ in range(self._steps()):
            u = torch.rand((), generator=g).item()
            counts, previous = [], 0
            for c in cumulative:
                edge = math.floor(c + u)
                counts.append(edge - previous)
                previous = edge
            slots = [k for k, n in enumerate(counts) for _ in range(n)]
            for j in torch.randperm(pps, generator=g).tolist():
                order.append(next(streams[slots[j]]))
        return order

    def _source_stream(self, k: int) -> Iterator[int]:
        """Source ``k``'s rows, in seeded permutations repeated for as long as they are drawn."""
        rows = self.rows_by_source[k]
        g = keyed_generator(self.seed, self.epoch, k)
        while rows:
            for i in torch.randperm(len(rows), generator=g).tolist():
                yield rows[i]

    def __len__(self) -> int:
        return self._steps() * self.prompts_per_step * self.num_generations
