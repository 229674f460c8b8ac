"""The papers' prompt sets by name (``dataset_name: pickscore``, ``ocr``, ``geneval``, ``drawbench``, their ``_test``
splits, and the mixture ``marble_5rewards``): shipped in the package where the file could be read, else fetched on first
use.

Each set is one file of a public GitHub repository at a pinned commit (flow_grpo, MIT; DiffusionNFT, Apache-2.0). Five
are shipped xz-compressed in ``marble_trl/data/prompt_data`` (3.7 MB of prompts in 0.7 MB, with the licences): they are
unpacked into the cache on first use, checked like a download, with no network. The others (``ocr``, ``geneval``) are
downloaded from ``raw.githubusercontent.com`` at that commit. Every file is checked against the digests recorded below
(SHA-256 and size where known, and always git's object id of the file at that commit) and kept in a cache:
``$MARBLE_TRL_CACHE/datasets/<name>/<digest>/<file>``, where ``MARBLE_TRL_CACHE`` defaults to
``$HF_HOME/marble_trl`` (``~/.cache/huggingface/marble_trl``). A file that fails the check is never kept. With
``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` / ``MARBLE_TRL_OFFLINE`` set, only the cache and the shipped copies are
read, and a set in neither is an error that names the set, its URL, its digest and how to place it by hand (``marble-trl datasets download NAME
--from FILE``). docs/data.md lists the sets with their provenance.

Two files of flow_grpo (``ocr``, ``geneval``: the train splits, 4 MiB or more) could not be read when this registry was
written, so their SHA-256, size and row count are not recorded: they are checked by their git object id alone (the
SHA-1 of ``b"blob <size>\\0" + content``, taken from the commit's tree), which pins the content as firmly against a
substituted file. ``marble-trl datasets download`` prints the SHA-256 of every file it verified, to record here.

The mixture ``marble_5rewards`` is the MARBLE release's training data (aim-uofa/MARBLE ``MixedPromptDataset`` with
``StratifiedKRepeatSampler``): the PickScore, OCR and GenEval train prompts in equal shares per step. It is a list of
:class:`~marble_trl.data.sources.PromptSource` specs, mixed by the ``source_ratios`` machinery like any ``dataset_mixture``.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

FLOW_GRPO = ("yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd")
DIFFUSION_NFT = ("NVlabs/DiffusionNFT", "24af5554898d85e93efa492f42b5e9cdf4156e9b")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "MARBLE_TRL_OFFLINE")
MAX_BYTES = 64 << 20  # a response larger than this is not a prompt file
SHIPPED = Path(__file__).parent / "prompt_data"


@dataclass(frozen=True)
class PromptSet:
    """One prompt file at a pinned commit, with what is known of its content.

    ``sha256`` / ``size`` / ``rows`` are ``None`` where the file could not be read when it was recorded; ``git_blob``
    (git's object id of the file at ``commit``) is always known and always checked.
    """

    name: str
    description: str
    repo: str
    commit: str
    path: str
    licence: str
    git_blob: str
    sha256: str | None
    size: int | None
    rows: int | None
    columns: tuple[str, ...] = ("prompt",)
    notes: str = ""
    url: str = field(default="")

    def __post_init__(self) -> None:
        if not self.url:
            object.__setattr__(self, "url", f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}")

    @property
    def filename(self) -> str:
        return Path(self.path).name

    @property
    def format(self) -> str:
        """``txt`` (one prompt per line) or ``jsonl`` (one object per line)."""
        return Path(self.path).suffix.lstrip(".")

    @property
    def digest(self) -> str:
        """The cache folder's name: the SHA-256's first 16 digits, else ``git-`` and the git object id's."""
        return self.sha256[:16] if self.sha256 else f"git-{self.git_blob[:16]}"

    @property
    def provenance(self) -> str:
        return f"{self.repo}@{self.commit[:12]}:{self.path}"


def _flow_grpo(name, description, path, **known) -> PromptSet:
    return PromptSet(name, description, *FLOW_GRPO, path, licence="MIT", **known)


_GENEVAL_COLUMNS = ("prompt", "tag", "include", "exclude")
_GENEVAL_NOTES = (
    "GenEval metadata: `tag` (the task), `include` (the objects to find: class, count, optional color / position), "
    "`exclude` (counting prompts only; None elsewhere)."
)

PROMPT_SETS: dict[str, PromptSet] = {
    s.name: s
    for s in (
        _flow_grpo(
            "pickscore",
            "PickScore prompts, train split: Pick-a-Pic v1 captions of 6+ words, deduplicated (flow_grpo)",
            "dataset/pickscore/train.txt",
            git_blob="a437bd921c03fbc00c4e7ce148ae2d28fcd6e49b",
            sha256="2f425adcbb9a6d0feee7c6c448e1cb83a1f71deca9434b803907e2578eca837f",
            size=2_906_730,
            rows=25_432,
            notes="772 prompts hold double-quoted text, which the OCR reward scores (as the release does).",
        ),
        _flow_grpo(
            "pickscore_test",
            "PickScore prompts, test split (2,048 Pick-a-Pic v1 captions held out by flow_grpo)",
            "dataset/pickscore/test.txt",
            git_blob="45f05231b969fb5f74c8debd606b22cd3be27f8e",
            sha256="d75c025fa451866e70f7e36243f7cdd93095523cb51f5f9651f2ce3236d20262",
            size=239_891,
            rows=2_048,
        ),
        _flow_grpo(
            "ocr",
            "OCR (text rendering) prompts, train split, the text to render in double quotes (flow_grpo)",
            "dataset/ocr/train.txt",
            git_blob="3ce0521b77b0a9031191d66ecc36ebaaf27a3922",
            sha256=None,  # 4 MiB or more: not readable when recorded; checked by git_blob
            size=None,
            rows=None,
        ),
        _flow_grpo(
            "ocr_test",
            "OCR (text rendering) prompts, test split, each with double-quoted text (flow_grpo)",
            "dataset/ocr/test.txt",
            git_blob="8deb4f8d8f2e863f45353354243669b3c991a6a2",
            sha256="4dd8caf3ab6ade73bd376c7d14c6ca49b6eacfb1bd321e22c40714ae4a98d4dc",
            size=217_565,
            rows=1_018,
        ),
        _flow_grpo(
            "geneval",
            "GenEval-format compositional prompts with their metadata, train split (flow_grpo)",
            "dataset/geneval/train_metadata.jsonl",
            git_blob="0b97e8a6802c08fc7537cd00c76ae79c851bddcb",
            sha256=None,  # 4 MiB or more: not readable when recorded; checked by git_blob
            size=None,
            rows=None,
            columns=_GENEVAL_COLUMNS,
            notes=_GENEVAL_NOTES + " Columns as the test split's (the train file could not be read when recorded).",
        ),
        _flow_grpo(
            "geneval_test",
            "GenEval's 553 evaluation prompts, each 4 times, with their metadata (flow_grpo)",
            "dataset/geneval/test_metadata.jsonl",
            git_blob="27cdaf5cc1356fe15aeadbb8df55682ca74228f0",
            sha256="cec4b24b9fee7bac21c8f787054ecc8dc9ff831674037713a4cd35e0f0a74a28",
            size=340_835,
            rows=2_212,
            columns=_GENEVAL_COLUMNS,
            notes=_GENEVAL_NOTES,
        ),
        PromptSet(
            "drawbench",
            "DrawBench (Imagen): its 200 prompts, each 5 times; DiffusionNFT's evaluation set (test split only)",
            *DIFFUSION_NFT,
            "dataset/drawbench/test.txt",
            licence="Apache-2.0",
            git_blob="8d96e7cf7017ce6ce299a6eec96e21467a2ac7aa",
            sha256="9006b98feabb94b28a2bc0c88de42fd4f31a9ec3c2a19e308a02c5385b7172f0",
            size=65_164,
            rows=1_000,
            notes="Quoted text is in single quotes, so the OCR reward is None on every prompt.",
        ),
    )
}

# Named mixtures: PromptSource specs (docs/data.md). The train mixture draws the three sets in equal shares per step,
# as the MARBLE release (2 prompts per source per sampling round: 16 / 16 / 16 of a step's 48); the test mixture is
# the release's evaluation set (every row of the three test splits), labelled with the same source names.
MIXTURES: dict[str, tuple[dict, ...]] = {
    "marble_5rewards": tuple({"path": n, "name": n, "ratio": 1.0} for n in ("pickscore", "ocr", "geneval")),
    "marble_5rewards_test": tuple({"path": f"{n}_test", "name": n} for n in ("pickscore", "ocr", "geneval")),
    # the papers' tables (DiffusionNFT, MARBLE): PickScore / HPSv2.1 / CLIPScore on DrawBench, OCR and GenEval on their
    # test splits; read each reward on its own source (`marble-trl evaluate` logs `<reward>/<source>/mean`)
    "paper_eval": (
        {"path": "drawbench", "name": "drawbench"},
        {"path": "ocr_test", "name": "ocr"},
        {"path": "geneval_test", "name": "geneval"},
    ),
}


class PromptSetError(RuntimeError):
    """A named prompt set that cannot be used: not cached while offline, not downloadable, or not the recorded file."""


def prompt_set(name: str) -> PromptSet:
    if name not in PROMPT_SETS:
        raise ValueError(f"Unknown prompt set {name!r}; known: {sorted(PROMPT_SETS)} (mixtures: {sorted(MIXTURES)}).")
    return PROMPT_SETS[name]


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
