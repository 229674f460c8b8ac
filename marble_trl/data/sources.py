"""Prompt sources: one or several prompt datasets mixed into one ``datasets.Dataset``.

A source is a prompt file (``.txt`` one prompt per line, ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet``), the
bundled tiny prompt file (``"bundled"``), the ShapesBench world (``"shapes"``, ...), a paper's prompt set by name
(``"pickscore"``, ``"ocr_test"``, ...: shipped or downloaded once, verified, :mod:`marble_trl.data.prompt_sets`), or a Hub
dataset id (loaded with ``datasets.load_dataset``). Every column other than the prompt reaches the reward functions
(GenEval metadata, the text to render, ...). A named mixture (``"marble_5rewards"``) is a list of sources:
:func:`named_mixture`.

Several sources are concatenated into one dataset with a ``source`` column (the source's ``name``); a column that
only some sources have is ``None`` in the rows of the others. Sampling shares are not encoded in the dataset: pass
:func:`mixture_ratios` as the config's ``source_ratios`` (``marble-trl train`` does it for you) and the
:class:`~marble_trl.data.prompts.GroupSampler` draws each step's prompts per source by ratio. Without ratios, rows are drawn
uniformly (each source in proportion to its size, like TRL's plain concatenation).

Naming follows TRL's ``DatasetConfig`` where the meaning is the same (``path``, ``split``, ``columns``); ``name`` is
this source's label (TRL's ``name``, the Hub configuration, is ``subset`` here) and ``ratio`` is a sampling share
(TRL's ``fraction`` truncates datasets instead).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .prompt_files import local_file
from .prompt_sets import MIXTURES, PROMPT_SETS
from .source_images import resolve_image_paths
from .table_files import FILE_FORMATS, load_file, warn_mixed_types

SOURCE_COLUMN = "source"


@dataclass
class PromptSource:
    """One prompt source of a mixture (a dataclass, so it reads from YAML dicts).

    Args:
        path: ``"bundled"``, ``"shapes"`` / ``"shapes_<family>"`` / ``"shapes_eval"``, a prompt set's name
            (:data:`~marble_trl.data.prompt_sets.PROMPT_SETS`), a local ``.txt`` / ``.json`` / ``.jsonl`` / ``.csv`` /
            ``.parquet`` file, or a Hub dataset id.
        ratio: share of the prompts drawn from this source (normalised over the mixture). Set it for every source
            or for none (none: rows drawn uniformly, each source in proportion to its size).
        name: label in the ``source`` column and in the per-source metrics (default: the file stem or the last part
            of the Hub id).
        split: split of a Hub dataset (a local file has one split, whatever this says).
        subset: configuration of a Hub dataset (``load_dataset(path, name=subset)``).
        prompt_column: the column holding the prompt text, renamed to ``prompt``.
        columns: extra columns to keep (default: all).
        max_prompts: keep only the first this many rows.
    """

    path: str
    ratio: float | None = None
    name: str | None = None
    split: str = "train"
    subset: str | None = None
    prompt_column: str = "prompt"
    columns: list[str] | None = None
    max_prompts: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"A prompt source needs a 'path' (a file, 'bundled' or a Hub id), got {self.path!r}.")
        if self.name is None:
            self.name = default_source_name(self.path)
        if self.ratio is not None:
            try:
                self.ratio = float(self.ratio)
            except (TypeError, ValueError) as err:
                raise ValueError(f"Source {self.name!r}: ratio must be a number, got {self.ratio!r}.") from err
            if not math.isfinite(self.ratio) or self.ratio < 0:
                raise ValueError(
                    f"Source {self.name!r}: ratio must be a finite number >= 0 (a share of the prompts), got "
                    f"{self.ratio}."
                )
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"Source {self.name!r}: max_prompts must be >= 1, got {self.max_prompts}.")
        if isinstance(self.columns, str):
            self.columns = [self.columns]

    @classmethod
    def from_spec(cls, spec: str | Mapping[str, Any] | PromptSource) -> PromptSource:
        """A source from a ``PromptSource``, a dict (YAML) or a string ``PATH`` / ``PATH=RATIO`` (command line)."""
        if isinstance(spec, PromptSource):
            return spec
        if isinstance(spec, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(spec) - known)
            if unknown:
                raise ValueError(
                    f"Prompt source {dict(spec)!r} has unknown keys {unknown}; known keys: {sorted(known)}."
                )
            return cls(**dict(spec))
        if isinstance(spec, str):
            path, sep, ratio = spec.rpartition("=")
            if sep and path:
                try:
                    return cls(path=path, ratio=float(ratio))
                except ValueError:
                    pass
            return cls(path=spec)
        raise TypeError(f"A prompt source is a path string, a dict or a PromptSource, got {type(spec).__name__}.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_source_name(path: str) -> str:
    """``prompts/ocr_train.jsonl`` -> ``ocr_train``; ``org/dataset`` -> ``dataset``; ``bundled`` -> ``bundled``."""
    local = Path(path).expanduser()
    if local.suffix.lstrip(".") in (*FILE_FORMATS, "txt"):
        return local.stem
    return path.rstrip("/").split("/")[-1]


def as_sources(specs: str | Mapping | PromptSource | Sequence[str | Mapping | PromptSource]) -> list[PromptSource]:
    """Normalise one spec or a list of specs; names must be unique (they label the ``source`` column)."""
    if isinstance(specs, (str, Mapping, PromptSource)):
        specs = [specs]
    sources = [PromptSource.from_spec(s) for s in specs]
    if not sources:
        raise ValueError("The dataset mixture is empty: give at least one prompt source.")
    names = [s.name for s in sources]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Prompt sources share the name(s) {duplicates}; give each source a distinct 'name' (it labels the "
            "'source' column and the per-source metrics)."
        )
    return sources


def mixture_ratios(specs) -> dict[str, float] | None:
    """Normalised sampling share of each source, or ``None`` when no source sets a ratio (uniform over rows)."""
    sources = as_sources(specs)
    given = [s.ratio for s in sources]
    if all(r is None for r in given):
        return None
    if any(r is None for r in given):
        missing = [s.name for s in sources if s.ratio is None]
        raise ValueError(
            f"Sources {missing} have no ratio while others do: set 'ratio' for every source of the mixture or for "
            "none (none: prompts drawn uniformly over all rows)."
        )
    return normalise_ratios({s.name: s.ratio for s in sources})


def normalise_ratios(ratios: Mapping[str, float], what: str = "ratios") -> dict[str, float]:
    """Ratios divided by their sum; they must be finite, >= 0, with a positive sum."""
    values = {}
    for name, r in ratios.items():
        try:
            r = float(r)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{what}: the ratio of source {name!r} must be a number, got {r!r}.") from err
        if not math.isfinite(r) or r < 0:
            raise ValueError(f"{what}: the ratio of source {name!r} must be a finite number >= 0, got {r}.")
        values[str(name)] = r
    total = sum(values.values())
    if not values or total <= 0:
        raise ValueError(
            f"{what} must sum to a positive number (got {dict(values)}); give at least one source a ratio > 0."
        )
    return {name: r / total for name, r in values.items()}


# Built-in prompt sources of the ShapesBench world (with its metadata columns): every caption, each family drawn
# equally often; the stratified evaluation captions; one family's captions (docs/shapesbench.md). A name table of
# loaders ("module:function" and its keyword arguments; it returns the Dataset): the benchmark sits above the core,
# which never imports it.
_SHAPES_FAMILIES = ("color", "count", "position", "general")  # shapesbench.world.FAMILIES (a test checks)
SHAPES_SOURCE_LOADERS: dict[str, tuple[str, dict[str, str]]] = {
    "shapes": ("marble_trl.shapesbench.world:train_dataset", {}),
    "shapes_eval": ("marble_trl.shapesbench.world:eval_dataset", {}),
    **{f"shapes_{f}": ("marble_trl.shapesbench.world:family_dataset", {"family": f}) for f in _SHAPES_FAMILIES},
    # the editing world (an editing model's rows: instruction, source image, the scorers' columns)
    "shapes_edit": ("marble_trl.shapesbench.edits:edit_dataset", {}),
    "shapes_edit_eval": ("marble_trl.shapesbench.edits:edit_eval_dataset", {}),
}
SHAPES_SOURCES = tuple(SHAPES_SOURCE_LOADERS)


def _load_shapes_source(name: str):
    target, kwargs = SHAPES_SOURCE_LOADERS[name]
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(**kwargs)


def named_mixture(name: str | None) -> list[PromptSource] | None:
    """The sources of a named mixture (``marble_5rewards``, ``marble_5rewards_test``: :mod:`marble_trl.data.prompt_sets`),
    or ``None`` when ``name`` is not one."""
    if name not in MIXTURES:
        return None
    return as_sources([dict(spec) for spec in MIXTURES[name]])


def is_builtin(path: str) -> bool:
    """Whether ``path`` names a source the package provides (``bundled``, ShapesBench, a prompt set or a mixture)
    rather than a file or a Hub dataset."""
    return path == "bundled" or path in SHAPES_SOURCES or path in PROMPT_SETS or path in MIXTURES


def load_source(source: PromptSource | str | Mapping):
    """One source as a ``datasets.Dataset`` whose first column is ``prompt`` (plus its extra columns)."""
    from .prompts import check_prompt_dataset, load_prompt_dataset

    source = PromptSource.from_spec(source)
    path = source.path
    local = Path(path).expanduser()
    suffix = local.suffix.lstrip(".").lower()
    origin = path
    if path in PROMPT_SETS:  # a paper's prompt set: the verified cached copy, unpacked or downloaded on first use
        entry = PROMPT_SETS[path]
        file = local_file(path)
        dataset = load_prompt_dataset(str(file)) if entry.format == "txt" else load_file(source.name, file, "jsonl")
        origin = f"prompt set {path!r} ({entry.provenance})"
    elif path in SHAPES_SOURCES:
        dataset = _load_shapes_source(path)
        origin = f"the ShapesBench world ({path})"
    elif path in MIXTURES:
        raise ValueError(
            f"Prompt source {source.name!r}: {path!r} is a named mixture, not one source: set dataset_name: {path} (or "
            f"eval_dataset_name), or list its sources in dataset_mixture ({[dict(s) for s in MIXTURES[path]]})."
        )
    elif path == "bundled" or suffix == "txt":
        dataset = load_prompt_dataset(path)
        origin = str(local) if path != "bundled" else "the bundled prompt file"
    elif suffix in FILE_FORMATS:
        if not local.is_file():
            raise FileNotFoundError(
                f"Prompt source {source.name!r}: file {str(local)!r} does not exist (check 'path' / dataset_name)."
            )
        dataset = resolve_image_paths(load_file(source.name, local, suffix), local.parent)
        origin = str(local)
    elif local.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise FileNotFoundError(
            f"Prompt source {source.name!r}: {path!r} is neither an existing .txt/.json/.jsonl/.csv/.parquet file, a "
            f"named prompt set ({', '.join(PROMPT_SETS)}) nor a Hub dataset id ('org/name')."
        )
    else:
        from datasets import load_dataset

        dataset = load_dataset(path, name=source.subset, split=source.split)
    columns = dataset.column_names
    warn_mixed_types(dataset, origin)
    if source.prompt_column not in columns:
        raise ValueError(
            f"Prompt source {source.name!r} ({path}) has no {source.prompt_column!r} column (columns: {columns}); "
            "set its 'prompt_column' to the column holding the prompts."
        )
    if source.prompt_column != "prompt":
        if "prompt" in columns:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(source.prompt_column, "prompt")
    if source.columns is not None:
        absent = sorted(set(source.columns) - set(dataset.column_names))
        if absent:
            raise ValueError(
                f"Prompt source {source.name!r}: 'columns' names {absent}, which it does not have (columns: "
                f"{dataset.column_names})."
            )
        dataset = dataset.select_columns(["prompt", *[c for c in source.columns if c != "prompt"]])
    if source.max_prompts is not None and len(dataset) > source.max_prompts:
        dataset = dataset.select(range(source.max_prompts))
    check_prompt_dataset(dataset, name=f"prompt source {source.name!r}", column=source.prompt_column, origin=origin)
    return dataset


def load_prompt_sources(specs, add_source_column: bool | None = None):
    """Load and concatenate prompt sources into one ``datasets.Dataset``.

    Args:
        specs: a source or a list of sources (:class:`PromptSource`, dicts, or ``PATH`` / ``PATH=RATIO`` strings).
        add_source_column: add a ``source`` column with each row's source name; default: with several sources.

    Columns missing in a source are ``None`` in its rows. A source that already has a ``source`` column cannot be
    labelled (rename that column first).
    """
    from datasets import Features, concatenate_datasets

    sources = as_sources(specs)
    mixture_ratios(sources)  # validate: all ratios or none, a positive sum
    if add_source_column is None:
        add_source_column = len(sources) > 1
    datasets = [load_source(s) for s in sources]
    if not add_source_column:
        if len(datasets) == 1:
            return datasets[0]
    else:
        for source, dataset in zip(sources, datasets):
            if SOURCE_COLUMN in dataset.column_names:
                raise ValueError(
                    f"Prompt source {source.name!r} already has a {SOURCE_COLUMN!r} column, which would hide the "
                    "source labels; rename it (or drop it with the source's 'columns')."
                )
    union: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for source, dataset in zip(sources, datasets):
        for column, feature in dataset.features.items():
            feature = _plain(feature)
            if column in union and union[column] != feature:
                merged = _merge(union[column], feature)
                if merged is None:
                    raise ValueError(
                        f"Column {column!r} has type {feature} in source {source.name!r} but {union[column]} in "
                        f"source {owner[column]!r}; make the types agree (or drop the column with the sources' "
                        "'columns')."
                    )
                feature = merged
            union[column] = feature
            owner.setdefault(column, source.name)
    aligned = []
    for source, dataset in zip(sources, datasets):
        for column in union:
            if column not in dataset.column_names:  # nulls, cast below (pyarrow builds no extension-type column, such
                dataset = dataset.add_column(column, [None] * len(dataset))  # as GenEval's Json, from None)
        dataset = dataset.select_columns(list(union))
        if dataset.features != Features(union):
            dataset = dataset.cast(Features(union))
        if add_source_column:
            dataset = dataset.add_column(SOURCE_COLUMN, [source.name] * len(dataset))
        aligned.append(dataset)
    return concatenate_datasets(aligned)


def _plain(feature: Any) -> Any:
    """``large_string`` (what some loaders produce) as ``string``, so sources from different loaders agree."""
    from datasets import Value

    if isinstance(feature, Value) and feature.dtype == "large_string":
        return Value("string")
    return feature


def _merge(a: Any, b: Any) -> Any:
    """The common type of a column in two sources: equal types, or a column of nulls adopting the other's type."""
    from datasets import Value

    if a == b:
        return a
    if isinstance(a, Value) and a.dtype == "null":
        return b
    if isinstance(b, Value) and b.dtype == "null":
        return a
    return None
