"""The papers' prompt sets by name (``dataset_name: pickscore``, ``ocr``, ``geneval``, ``drawbench``, their ``_test``
splits, and the mixture ``marble_5rewards``): the registry of what each set is, where it comes from and what its file
must be; the files themselves (shipped, cached, downloaded, verified) are :mod:`marble_trl.data.prompt_files`'s.

Each set is one file of a public GitHub repository at a pinned commit (flow_grpo, MIT; DiffusionNFT, Apache-2.0). Five
are shipped xz-compressed in ``marble_trl/data/prompt_data``; the others (``ocr``, ``geneval``) are downloaded from
``raw.githubusercontent.com`` at that commit. Every file is checked against the digests recorded below (SHA-256 and size
where known, and always git's object id of the file at that commit). docs/data.md lists the sets with their provenance.

Two files of flow_grpo (``ocr``, ``geneval``: the train splits, 4 MiB or more) could not be read when this registry was
written, so their SHA-256, size and row count are not recorded: they are checked by their git object id alone (the
SHA-1 of ``b"blob <size>\\0" + content``, taken from the commit's tree), which pins the content as firmly against a
substituted file. ``marble-trl datasets download`` prints the SHA-256 of every file it verified, to record here.

The mixture ``marble_5rewards`` is the MARBLE release's training data (aim-uofa/MARBLE ``MixedPromptDataset`` with
``StratifiedKRepeatSampler``): the PickScore, OCR and GenEval train prompts in equal shares per step. It is a list of
:class:`~marble_trl.data.sources.PromptSource` specs, mixed by the ``source_ratios`` machinery like any ``dataset_mixture``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

FLOW_GRPO = ("yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd")
DIFFUSION_NFT = ("NVlabs/DiffusionNFT", "24af5554898d85e93efa492f42b5e9cdf4156e9b")


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


def prompt_set(name: str) -> PromptSet:
    if name not in PROMPT_SETS:
        raise ValueError(f"Unknown prompt set {name!r}; known: {sorted(PROMPT_SETS)} (mixtures: {sorted(MIXTURES)}).")
    return PROMPT_SETS[name]
