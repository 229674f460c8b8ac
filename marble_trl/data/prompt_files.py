"""The local copies of the named prompt sets (:mod:`marble_trl.data.prompt_sets`): the cache, the check against the
recorded digests, the package's shipped copies, the download, the copy placed by hand, and offline use.

Five sets are shipped xz-compressed in ``marble_trl/data/prompt_data`` (3.7 MB of prompts in 0.7 MB, with the
licences): they are unpacked into the cache on first use, checked like a download, with no network. The others
(``ocr``, ``geneval``) are downloaded from ``raw.githubusercontent.com`` at their pinned commit. Every file is checked
against the digests recorded in the registry (SHA-256 and size where known, and always git's object id of the file at
that commit) and kept in a cache: ``$MARBLE_TRL_CACHE/datasets/<name>/<digest>/<file>``, where ``MARBLE_TRL_CACHE``
defaults to ``$HF_HOME/marble_trl`` (``~/.cache/huggingface/marble_trl``). A file that fails the check is never kept.
With ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` / ``MARBLE_TRL_OFFLINE`` set, only the cache and the shipped copies
are read, and a set in neither is an error that names the set, its URL, its digest and how to place it by hand
(``marble-trl datasets download NAME --from FILE``).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import lzma
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .prompt_sets import PromptSet, prompt_set

logger = logging.getLogger(__name__)

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "MARBLE_TRL_OFFLINE")
MAX_BYTES = 64 << 20  # a response larger than this is not a prompt file
SHIPPED = Path(__file__).parent / "prompt_data"


class PromptSetError(RuntimeError):
    """A named prompt set that cannot be used: not cached while offline, not downloadable, or not the recorded file."""


def cache_root() -> Path:
    """``MARBLE_TRL_CACHE``, else ``$HF_HOME/marble_trl`` (``HF_HOME`` defaulting as in huggingface_hub)."""
    if os.environ.get("MARBLE_TRL_CACHE"):
        return Path(os.environ["MARBLE_TRL_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(hf_home).expanduser() / "marble_trl"


def cached_path(entry: PromptSet) -> Path:
    """Where the verified file lives in the cache (it may not be there yet)."""
    return cache_root() / "datasets" / entry.name / entry.digest / entry.filename


def shipped_path(entry: PromptSet) -> Path | None:
    """The package's compressed copy of the set (``prompt_data/<name>-<sha256[:16]><ext>.xz``), or ``None``: only sets
    with a recorded SHA-256 are shipped, and the file name carries it, so an entry with other digests finds none."""
    if entry.sha256 is None:
        return None
    path = SHIPPED / f"{entry.name}-{entry.sha256[:16]}{Path(entry.filename).suffix}.xz"
    return path if path.is_file() else None


def available_offline(entry: PromptSet) -> bool:
    """Whether the set loads without a network: shipped, or in the cache (not re-verified)."""
    return shipped_path(entry) is not None or cached_path(entry).is_file()


def offline() -> str | None:
    """The variable that turns downloads off (``HF_HUB_OFFLINE=1`` ...), or ``None``."""
    for variable in OFFLINE_VARIABLES:
        if os.environ.get(variable, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return variable
    return None


def git_blob_id(data: bytes) -> str:
    """git's object id of a file with this content (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def verify(entry: PromptSet, file: Path) -> str:
    """Check ``file`` against the recorded size, SHA-256 and git object id; returns its SHA-256. A mismatch raises
    :class:`PromptSetError` naming the expected and the actual values."""
    data = file.read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    checks = [
        ("size", entry.size, len(data)),
        ("SHA-256", entry.sha256, sha256),
        ("git blob id", entry.git_blob, None),
    ]
    for what, expected, actual in checks:
        if expected is None:
            continue
        actual = git_blob_id(data) if actual is None else actual
        if actual != expected:
            raise PromptSetError(
                f"Prompt set {entry.name!r}: {file} is not the recorded file ({entry.provenance}): expected {what} "
                f"{expected}, got {actual} (SHA-256 {sha256}, {len(data)} bytes)."
            )
    return sha256


def _where(entry: PromptSet) -> str:
    digest = f"SHA-256 {entry.sha256}, {entry.size} bytes" if entry.sha256 else "SHA-256 not recorded"
    return f"{entry.url} ({digest}; git blob id {entry.git_blob})"


def _how_to_place(entry: PromptSet) -> str:
    return (
        f"On a machine with internet, run `marble-trl datasets download {entry.name}` and copy "
        f"{cached_path(entry).parent} to the same place here (or set MARBLE_TRL_CACHE to a copied cache); or "
        f"download {_where(entry)} and run `marble-trl datasets download {entry.name} --from FILE`, which checks it "
        "and copies it into the cache."
    )


def local_file(name: str) -> Path:
    """The verified local copy of prompt set ``name``: from the cache, else unpacked from the package, else downloaded
    (unless offline)."""
    entry = prompt_set(name)
    target = cached_path(entry)
    if target.is_file():
        try:
            verify(entry, target)
            return target
        except PromptSetError as err:
            logger.warning("%s Removing it from the cache.", err)
            target.unlink(missing_ok=True)
    if shipped_path(entry) is not None:
        try:
            return unpack(name)
        except PromptSetError as err:  # a damaged installation: the pinned URL has the same file
            if offline():
                raise
            logger.warning("%s Downloading it instead.", err)
    variable = offline()
    if variable:
        raise PromptSetError(
            f"Prompt set {name!r} ({entry.description}) is not in the cache ({target}) and downloads are off "
            f"({variable}={os.environ[variable]}). {_how_to_place(entry)}"
        )
    return download(name)


def download(name: str, *, timeout: float = 60.0, attempts: int = 3) -> Path:
    """Download prompt set ``name`` into the cache (replacing a cached copy), verified: a temporary file in the cache
    folder, renamed into place only after it matches the recorded digests (a partial or wrong file is never kept)."""
    entry = prompt_set(name)
    target = cached_path(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        fd, part = tempfile.mkstemp(dir=target.parent, prefix=f".{entry.filename}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                _fetch(entry, out, timeout)
            sha256 = verify(entry, Path(part))
            os.replace(part, target)
            logger.info("Prompt set %r: downloaded %s (SHA-256 %s) -> %s", name, entry.url, sha256, target)
            return target
        except (OSError, http.client.HTTPException) as err:  # URLError, HTTPError, timeouts, a dropped connection
            if attempt == attempts or (isinstance(err, urllib.error.HTTPError) and err.code < 500):
                raise PromptSetError(
                    f"Prompt set {name!r}: could not download {entry.url} ({type(err).__name__}: {err}; "
                    f"{attempt} attempt(s)). {_how_to_place(entry)}"
                ) from err
            time.sleep(min(2.0**attempt, 10.0))
        finally:
            Path(part).unlink(missing_ok=True)
    raise AssertionError("unreachable")  # pragma: no cover


def unpack(name: str) -> Path:
    """Unpack the package's copy of prompt set ``name`` into the cache, verified as a download is."""
    entry = prompt_set(name)
    source = shipped_path(entry)
    if source is None:
        raise PromptSetError(f"Prompt set {name!r} is not shipped in the package; download it instead.")
    try:
        return _copy_into_cache(entry, lambda: lzma.open(source, "rb"))
    except (lzma.LZMAError, EOFError) as err:
        raise PromptSetError(f"Prompt set {name!r}: the package's copy {source} is damaged ({err}).") from err


def _copy_into_cache(entry: PromptSet, open_source: Callable[[], BinaryIO]) -> Path:
    """Copy what ``open_source()`` reads into the cache: a temporary file in the cache folder, renamed into place only
    after it matches the recorded digests (a partial or wrong copy is never kept)."""
    target = cached_path(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, part = tempfile.mkstemp(dir=target.parent, prefix=f".{entry.filename}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, open_source() as src:
            shutil.copyfileobj(src, out)
        verify(entry, Path(part))  # what was copied, not only what was read
        os.replace(part, target)
    finally:
        Path(part).unlink(missing_ok=True)
    return target


def _fetch(entry: PromptSet, out, timeout: float) -> None:
    limit = (entry.size or MAX_BYTES) + 1  # one byte more than expected: a longer file fails the size check
    request = urllib.request.Request(entry.url, headers={"User-Agent": "marble-trl"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        received = 0
        while chunk := response.read(min(1 << 20, limit - received)):
            out.write(chunk)
            received += len(chunk)
            if received >= limit:
                return  # longer than recorded: the size check refuses it
        announced = response.headers.get("Content-Length")
        if announced is not None and announced.isdigit() and int(announced) != received:
            raise ConnectionError(f"the connection closed after {received} of {announced} bytes")  # retried


def install(name: str, file: str | Path) -> Path:
    """Copy a file obtained by hand into the cache after checking it (``marble-trl datasets download NAME --from``)."""
    entry = prompt_set(name)
    source = Path(file).expanduser()
    if not source.is_file():
        raise PromptSetError(f"Prompt set {name!r}: {str(source)!r} is not a file.")
    verify(entry, source)
    return _copy_into_cache(entry, lambda: open(source, "rb"))


def describe(entry: PromptSet) -> dict:
    """Everything recorded about a set, plus its cache path and whether a copy is there (not re-verified)."""
    target = cached_path(entry)
    return {
        "name": entry.name,
        "description": entry.description,
        "url": entry.url,
        "provenance": entry.provenance,
        "licence": entry.licence,
        "sha256": entry.sha256,
        "git_blob": entry.git_blob,
        "size": entry.size,
        "rows": entry.rows,
        "columns": list(entry.columns),
        "notes": entry.notes,
        "shipped": shipped_path(entry) is not None,
        "cache_path": str(target),
        "cached": target.is_file(),
    }
