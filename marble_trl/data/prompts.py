"""Prompt datasets and the group sampler.

The trainer reads a :class:`datasets.Dataset` with a ``prompt`` column; every other column is passed to the reward
functions. :class:`GroupSampler` repeats each prompt ``num_generations`` times in a row (one group), like TRL GRPO's
``RepeatSampler``, and yields only whole optimizer steps of ``prompts_per_step`` groups. With several prompt sources
(a ``source`` column, see :mod:`marble_trl.data.sources`) and sampling ratios, it draws each step's prompts per source by
ratio.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import Sampler

from ..seeding import keyed_generator

BUNDLED_PROMPTS = "tiny_prompts.txt"


def bundled_prompts_path() -> Path:
    """Path of the prompt file shipped with the package (used by the tiny CPU recipe)."""
    return Path(str(resources.files("marble_trl.data") / BUNDLED_PROMPTS))


def check_utf8(file: Path) -> None:
    """A text prompt file must be UTF-8: a clear error naming the file, the line, the column and the byte otherwise
    (Python's ``UnicodeDecodeError`` names only a position, pyarrow's ``ArrowInvalid`` nothing at all)."""
    data = file.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(
            f"Prompt file {str(file)!r}: line {line}, column {column} is not UTF-8 (byte 0x{data[err.start]:02x} at "
            f"offset {err.start}). Save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 in > out` (or the "
            "encoding it was written in)."
        ) from None


def load_prompt_dataset(path: str | None = None):
    """A ``datasets.Dataset`` with a ``prompt`` column from a text file (one prompt per line; blank lines and
    ``#`` comments skipped). ``None`` or ``"bundled"`` loads the packaged tiny prompt file."""
    from datasets import Dataset

    file = bundled_prompts_path() if path in (None, "bundled") else Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"Prompt file {str(file)!r} does not exist (dataset_name / prompt file).")
    check_utf8(file)
    prompts = [ln.strip() for ln in file.read_text(encoding="utf-8").splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise ValueError(f"Prompt file {str(file)!r} holds no prompt.")
    return Dataset.from_dict({"prompt": prompts})


def check_prompt_dataset(
    dataset, name: str = "train_dataset", *, column: str = "prompt", origin: str | None = None
) -> None:
    """Clear errors for datasets the trainer cannot use, raised when the dataset is loaded or given to the trainer
    rather than mid-run.

    Checks that ``dataset`` is a non-empty ``datasets.Dataset`` with a ``prompt`` column whose every row is a
    non-empty string (not ``None``, not a number, not only whitespace). A bad row raises ``ValueError`` naming its
    (0-based) row index, the column (``column``: the name it has in the source, e.g. before ``prompt_column`` renamed
    it), ``origin`` (the file or Hub id) when known, and the row's ``source`` when the dataset has that column.
    """
    where = f"{name} ({origin})" if origin else name
    if dataset is None:
        raise ValueError(f"{name} is required: a datasets.Dataset with a 'prompt' column.")
    if not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
        raise TypeError(f"{name} must be a datasets.Dataset (with a 'prompt' column), got {type(dataset).__name__}.")
    if len(dataset) == 0:
        raise ValueError(f"{where} is empty: it needs at least one prompt.")
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"{where} has no 'prompt' column (columns: {dataset.column_names}); rename your text column with "
            "dataset.rename_column(<name>, 'prompt')."
        )
    count, bad = _bad_prompts(dataset)
    if not count:
        return
    col = "'prompt'" if column == "prompt" else f"{column!r} (prompt_column, renamed 'prompt')"
    rows = []
    for row, value in bad:
        kind = "" if value is None or isinstance(value, str) else f" ({type(value).__name__})"
        text = f"row {row} holds {value!r}{kind}"
        if "source" in dataset.column_names:
            text += f" (source {dataset[row]['source']!r})"
        rows.append(text)
    more = f"; and {count - len(bad)} more" if count > len(bad) else ""
    raise ValueError(
        f"{where}: every prompt must be a non-empty string, but {count} row(s) of column {col} are not: "
        f"{'; '.join(rows)}{more} (rows counted from 0). Fix or drop those rows before training."
    )


def _is_prompt(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _bad_prompts(dataset, limit: int = 3) -> tuple[int, list[tuple[int, object]]]:
    """Number of rows whose prompt is not a non-empty string, and the first ``limit`` of them as (row, value)."""
    fast = _bad_prompts_arrow(dataset, limit)
    if fast is not None:
        return fast
    count, bad = 0, []
    if hasattr(dataset, "iter"):  # datasets.Dataset: batches (one row at a time through a Column is slow)
        batches = (b["prompt"] for b in dataset.iter(batch_size=4096))
    else:
        batches = iter([list(dataset["prompt"])])
    row = 0
    for batch in batches:
        for value in batch:
            if not _is_prompt(value):
                count += 1
                if len(bad) < limit:
                    bad.append((row, value))
            row += 1
    return count, bad


def _bad_prompts_arrow(dataset, limit: int) -> tuple[int, list[tuple[int, object]]] | None:
    """The same with pyarrow compute, for a ``datasets.Dataset`` whose prompt column is stored as strings (the usual
    case: a million rows in about a second); ``None`` when that does not apply."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        from datasets import Dataset, Value
    except ImportError:  # pragma: no cover - datasets depends on pyarrow
        return None
    if not isinstance(dataset, Dataset):
        return None
    feature = dataset.features.get("prompt")
    if not (isinstance(feature, Value) and feature.dtype in ("string", "large_string")):
        return None

    def bad_mask(column):
        empty = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0)
        return pc.fill_null(empty, True)  # a null prompt is bad too

    # The stored table first (no gather): when it is clean, so is any selection or shuffle of it.
    table = dataset.data.column("prompt")
    bad = bad_mask(table)
    if not (pc.sum(bad).as_py() or 0):
        return 0, []
    if getattr(dataset, "_indices", None) is not None:  # rows selected / shuffled: check them in the dataset's order
        column = dataset.with_format("arrow")["prompt"]
        bad = bad_mask(column.column(0) if isinstance(column, pa.Table) else column)
    count = pc.sum(bad).as_py() or 0
    rows = pc.indices_nonzero(bad)[:limit].to_pylist()
    return count, [(row, dataset[row]["prompt"]) for row in rows]


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
