"""Publishing to the Hugging Face Hub: uploading a folder (:func:`push_folder`) and the prompts recorded with a
folder's sample images (:func:`recorded_prompts`). The model card it uploads is :mod:`marble_trl.publish.card`.

Every Hub call goes through :func:`hub_api` (``huggingface_hub.HfApi``; the endpoint is ``HF_ENDPOINT`` unless given).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .._version import __version__
from ..artifacts import PUSH_IGNORE, SAMPLES_DIR


# ------------------------------------------------------------------------------------------------- the Hub
def hub_api(endpoint: str | None = None, token: str | None = None):
    """An ``HfApi`` for ``endpoint`` (default: ``HF_ENDPOINT``, else huggingface.co)."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token, library_name="marble_trl", library_version=__version__)


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = "Upload LoRA trained with marble_trl",
    endpoint: str | None = None,
    ignore_patterns: list[str] | None = None,
):
    """Create ``repo_id`` if needed and upload ``folder`` (one commit). Returns the ``CommitInfo``."""
    api = hub_api(endpoint, token)
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(
        repo_id=url.repo_id,
        folder_path=str(folder),
        commit_message=commit_message,
        revision=revision,
        ignore_patterns=PUSH_IGNORE if ignore_patterns is None else ignore_patterns,
    )


def recorded_prompts(folder: Path) -> dict[str, str]:
    path = folder / SAMPLES_DIR / "prompts.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
