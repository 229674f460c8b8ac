"""Synthetic stand-ins for the named prompt sets (marble_trl.data.prompt_sets), so that tests resolve ``pickscore``,
``ocr``, ``geneval``, ... through the real code (cache, verification, loading, mixing) offline.

:func:`synthetic_files` writes small files in each set's format; :func:`patch_registry` points every registry entry at
them (their SHA-256, size and git object id, and optionally a URL); :func:`install_synthetic` does both and installs
the files into a cache folder (``MARBLE_TRL_CACHE``) with the real :func:`marble_trl.data.prompt_files.install`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from marble_trl.data import prompt_files, prompt_sets

# Rows of each set: plain prompts, quoted text (OCR applies), GenEval metadata (a position given as [str, int]).
TEXT = {
    "pickscore": ["a red apple on a table", "a blue boat on a lake", 'a mug printed with "GOOD MORNING"', "a fox"],
    "pickscore_test": ["a lighthouse at dusk", "a bowl of ramen"],
    "ocr": ['a shop sign that says "OPEN"', 'a poster with the words "HELLO MARBLE"', 'a cake with "70" on it'],
    "ocr_test": ['a street sign reading "MAIN ST"', 'a book titled "Flow"'],
    "drawbench": ["A giraffe riding a bicycle.", "A bakery window with 'Fresh Bread' painted on it."],
}
GENEVAL = {
    "geneval": [
        {
            "tag": "counting",
            "include": [{"class": "cat", "count": 2}],
            "exclude": [{"class": "cat", "count": 3}],
            "prompt": "a photo of two cats",
        },
        {
            "tag": "colors",
            "include": [{"class": "bench", "count": 1, "color": "red"}],
            "prompt": "a photo of a red bench",
        },
        {
            "tag": "position",
            "include": [{"class": "cup", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
            "prompt": "a photo of a dog right of a cup",
        },
    ],
    "geneval_test": [
        {"tag": "single_object", "include": [{"class": "clock", "count": 1}], "prompt": "a photo of a clock"},
        {
            "tag": "counting",
            "include": [{"class": "kite", "count": 3}],
            "exclude": [{"class": "kite", "count": 4}],
            "prompt": "a photo of three kites",
        },
    ],
}


def synthetic_bytes(name: str) -> bytes:
    if name in TEXT:
        return "".join(p + "\n" for p in TEXT[name]).encode()
    return "".join(json.dumps(row) + "\n" for row in GENEVAL[name]).encode()


def synthetic_files(folder: Path) -> dict[str, Path]:
    """One synthetic file per registered set, named as the real one, in ``folder/<name>/``."""
    files = {}
    for name, entry in prompt_sets.PROMPT_SETS.items():
        file = folder / name / entry.filename
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(synthetic_bytes(name))
        files[name] = file
    return files


def patch_registry(monkeypatch, files: dict[str, Path], base_url: str | None = None) -> None:
    """Point each set's recorded digests (and URL, under ``base_url``) at its synthetic file."""
    for name, file in files.items():
        data = file.read_bytes()
        entry = prompt_sets.PROMPT_SETS[name]
        patched = dataclasses.replace(
            entry,
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
            rows=len(data.splitlines()),
            git_blob=prompt_files.git_blob_id(data),
            url=f"{base_url}/{name}/{entry.filename}" if base_url else entry.url,
        )
        monkeypatch.setitem(prompt_sets.PROMPT_SETS, name, patched)


def install_synthetic(monkeypatch, folder: Path) -> Path:
    """Synthetic sets installed in a cache at ``folder/cache`` (``MARBLE_TRL_CACHE``); returns the cache."""
    cache = folder / "cache"
    monkeypatch.setenv("MARBLE_TRL_CACHE", str(cache))
    files = synthetic_files(folder / "files")
    patch_registry(monkeypatch, files)
    for name, file in files.items():
        prompt_files.install(name, file)
    return cache
