"""Exports written atomically: a staging folder next to the output, renamed to it when everything in it is written,
so that a failed export (say, while rendering samples) leaves no partial folder and a replaced export stays as it was."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_folder(output: Path) -> Iterator[Path]:
    """A temporary folder beside ``output``; renamed to ``output`` when the block succeeds, removed in every case."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.export-", dir=output.parent))
    try:
        yield staging
        _replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace(staging: Path, output: Path) -> None:
    """Rename the finished ``staging`` folder to ``output`` (a previous ``output`` is removed only afterwards)."""
    old = None
    if output.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        old.rmdir()
        os.replace(output, old)
    try:
        os.replace(staging, output)
    except BaseException:
        if old is not None:
            os.replace(old, output)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
