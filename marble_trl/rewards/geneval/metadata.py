"""Reading GenEval's per-prompt metadata from the dataset columns a reward receives.

Two layouts are accepted (docs/rewards.md, docs/data.md):

- GenEval's fields as columns of their own, as in its ``evaluation_metadata.jsonl`` and flow_grpo's train/test
  metadata files: ``tag``, ``include`` and, on counting prompts, ``exclude`` (what the recipes assume);
- one ``metadata`` column holding each row's whole dict (or its JSON text), as MARBLE's mixed dataset does.

A row whose ``metadata`` value is not such a dict falls back to the separate columns. A row is a GenEval row when it
has an ``include`` list (MARBLE's reference filters the same way); any other row gets ``None``, "not applicable".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..base import dataset_columns

FIELDS = ("tag", "include", "exclude")
METADATA_COLUMN = "metadata"


def _parsed(value: Any) -> Any:
    # A CSV or hand-built dataset may hold the dict or the lists as JSON text.
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def row_metadata(columns: Mapping[str, Sequence[Any]], batch: int) -> list[dict[str, Any] | None]:
    """Each row's GenEval metadata (``tag``, ``include``, ``exclude``, ...), or ``None`` for a row without it."""
    columns = dataset_columns(columns)  # not trainer_state / log_metric / log_extra
    for key in (METADATA_COLUMN, *FIELDS):
        if key in columns and len(columns[key]) != batch:
            raise ValueError(f"GenEval column {key!r} has {len(columns[key])} values for {batch} samples.")
    out: list[dict[str, Any] | None] = []
    for i in range(batch):
        meta = _parsed(columns[METADATA_COLUMN][i]) if METADATA_COLUMN in columns else None
        if not (isinstance(meta, Mapping) and meta.get("include") is not None):
            meta = {key: columns[key][i] for key in FIELDS if key in columns}
        meta = {key: _parsed(value) for key, value in meta.items()}
        include = meta.get("include")
        if include is None:
            out.append(None)
            continue
        if not isinstance(include, (list, tuple)):
            raise ValueError(f"Row {i}: GenEval's 'include' must be a list of requirements, got {include!r}.")
        out.append(meta)
    return out
