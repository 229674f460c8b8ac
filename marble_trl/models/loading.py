"""Where a ``model_name_or_path`` points, and what pipeline class it holds, for every family.

A Hub id is ``"name"`` or ``"org/name"``; anything with more parts or a path prefix is a local path, and a local path
that does not exist is an error (it is never mistaken for a Hub id). The pipeline class comes from the folder's
``model_index.json`` (``_class_name``), as in ``diffusers.DiffusionPipeline.from_pretrained``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

OFFLINE_HINT = "'tiny', 'tiny-flux', 'tiny-wan', 'tiny-qwen-image', 'tiny-z-image' or 'shapes' for the offline models"


def local_folder(name_or_path: str | os.PathLike) -> Path | None:
    """The existing local folder ``name_or_path`` names, ``None`` for a Hub id; an error for a missing local path."""
    name = str(name_or_path)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    expanded = Path(name).expanduser()
    if expanded.exists():
        return expanded
    if looks_local:
        raise FileNotFoundError(
            f"model_name_or_path {name!r} is not an existing folder. Give a local diffusers folder, a Hub id such as "
            f"'stabilityai/stable-diffusion-3.5-medium', or {OFFLINE_HINT}."
        )
    return None


def model_index(folder: Path) -> dict:
    index = folder / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{folder} has no model_index.json: it is not a diffusers pipeline folder.")
    return json.loads(index.read_text())


def pipeline_class_name(name_or_path: str | os.PathLike) -> str:
    """The ``_class_name`` of the pipeline at a local folder or Hub id (a Hub id reads only ``model_index.json``)."""
    folder = local_folder(name_or_path)
    if folder is not None:
        entries = model_index(folder)
    else:
        from diffusers import DiffusionPipeline

        entries = DiffusionPipeline.load_config(str(name_or_path))
    name = entries.get("_class_name")
    if not name:
        raise ValueError(f"{name_or_path}: model_index.json names no _class_name, so its model family is unknown.")
    return name


def absent_components(folder: Path) -> dict[str, None]:
    """Components saved as ``[null, null]`` (e.g. SD3 without T5): diffusers wants them passed explicitly as None."""
    return {
        name: None
        for name, value in model_index(folder).items()
        if isinstance(value, list) and len(value) == 2 and value[0] is None and value[1] is None
    }


def from_pretrained(pipeline_cls, name_or_path: str | os.PathLike, torch_dtype: torch.dtype | None = None):
    """``pipeline_cls.from_pretrained`` of a local folder or Hub id, with absent components passed as None."""
    kwargs: dict = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
    folder = local_folder(name_or_path)
    if folder is not None:
        kwargs.update(absent_components(folder))
        return pipeline_cls.from_pretrained(str(folder), **kwargs)
    return pipeline_cls.from_pretrained(str(name_or_path), **kwargs)


def cast_built(pipe, torch_dtype: torch.dtype | None):
    """A pipeline built in float32 (the offline tiny models), cast to ``torch_dtype``."""
    if torch_dtype is not None and torch_dtype != torch.float32:
        # nn.Module.to, not ModelMixin.to: diffusers' warns that it would keep "[]" in float32.
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                torch.nn.Module.to(component, dtype=torch_dtype)
    return pipe


def seeded_build(seed: int, build):
    """``build()`` under ``torch.manual_seed(seed)``, leaving the global RNG as it was."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return build()
    finally:
        torch.random.set_rng_state(state)
