"""Prompt tables: a local ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` prompt file read as a ``datasets.Dataset``
(:func:`load_file`: an empty or unreadable file is an error naming the file and its expected format), and the check
of a loaded table's columns for values whose type changes between rows (:func:`warn_mixed_types`). The prompt sources
(:mod:`marble_trl.data.sources`) read their files with these.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_FORMATS = {"json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet"}


def warn_mixed_types(dataset, origin: str, limit: int = 100_000) -> None:
    """A warning naming a column whose values change type between rows (``2`` then ``"two"``; ``None`` is "not
    given" and mixes with anything): ``datasets`` keeps such a column as JSON objects, and the rewards get both types."""
    if len(dataset) > limit:
        return  # a large dataset: its loader typed it already; checking costs a full pass
    for column in dataset.column_names:
        values = dataset[column]
        first: dict[type, int] = {}
        for row, value in enumerate(values):
            if value is not None:
                first.setdefault(type(value), row)
        if len(first) > 1:
            kinds = ", ".join(f"{t.__name__} (first at row {r})" for t, r in sorted(first.items(), key=lambda x: x[1]))
            logger.warning(
                "%s: column %r holds values of several types: %s. The rewards receive them as they are; make the "
                "column one type (or None where it does not apply) if that is not intended.",
                origin,
                column,
                kinds,
            )


def load_file(name: str, file: Path, suffix: str):
    """A local ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file as a ``datasets.Dataset``. An empty file (no
    bytes, only whitespace, ``[]``, a CSV header alone, a Parquet file of 0 rows) raises ``ValueError`` naming the file
    (``datasets`` gives a bare ``StopIteration`` or "Instruction 'train' corresponds to no data" instead), and so does
    a file ``datasets`` cannot read."""
    from datasets import load_dataset

    fmt = FILE_FORMATS[suffix]
    if suffix != "parquet":  # text formats: an encoding error names the line (parquet stores UTF-8 by format)
        from .prompts import check_utf8

        check_utf8(file)
    if _has_no_rows(file, suffix):
        raise ValueError(
            f"Prompt source {name!r}: file {str(file)!r} is empty (no rows); it needs at least one row with a "
            f"prompt ({_FORMAT_HINTS[suffix]})."
        )
    try:
        return load_dataset(fmt, data_files=str(file), split="train")
    except Exception as err:  # datasets' errors name neither the file nor the fix
        cause = err.__cause__ or err.__context__
        detail = f"{type(err).__name__}: {err}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
        raise ValueError(
            f"Prompt source {name!r}: could not read {str(file)!r} as {suffix} ({_FORMAT_HINTS[suffix]}): {detail}"
        ) from err


_FORMAT_HINTS = {
    "json": 'a JSON list of objects such as [{"prompt": "a cat"}], or one object per line',
    "jsonl": 'one JSON object per line, such as {"prompt": "a cat"}',
    "csv": "a header line naming the columns, then one row per prompt",
    "parquet": "a table with a prompt column",
}


def _has_no_rows(file: Path, suffix: str, small: int = 1 << 20) -> bool:
    """Whether a prompt file plainly holds no rows. Only files up to ``small`` bytes are read (Parquet: its footer);
    anything else is left to ``datasets``."""
    size = file.stat().st_size
    if size == 0:
        return True
    if suffix == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_metadata(file).num_rows == 0
        except Exception:  # not a Parquet file: datasets' error, re-raised naming the file, says so
            return False
    if size > small:
        return False
    text = file.read_text(encoding="utf-8", errors="replace").strip()
    if not text:
        return True
    if suffix == "json" and text[0] in "[{":
        import json

        try:
            return json.loads(text) in ([], {})
        except ValueError:
            return False
    if suffix == "csv":
        return len([line for line in text.splitlines() if line.strip()]) <= 1
    return False
