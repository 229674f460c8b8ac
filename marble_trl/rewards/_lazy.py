"""Lazy imports of optional dependencies, failing with an install hint that names the reward."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, *, reward: str, hint: str) -> ModuleType:
    """Import ``module`` or raise :class:`ImportError` saying which reward needs it and how to install it.

    ``hint`` is the install command (e.g. ``pip install "marble-trl[ocr]"``). Any ImportError is wrapped, not only a
    missing module: an installed package that fails to import (a broken or incompatible version) needs the same hint.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"The {reward!r} reward needs the optional dependency {module!r}, which could not be imported ({err}). "
            f"Install it with: {hint}"
        ) from err
