"""One run per ``output_dir``: a lock file held while ``train()`` runs, and no silent overwrite of an earlier run.

``<output_dir>/.marble_trl.lock`` holds the owner's pid, host and start time; it is created atomically
(``O_CREAT | O_EXCL``) by the main process when training starts and removed when it ends, also on errors. A second
run on the same folder fails at start naming the owner. A lock whose pid no longer runs on this host is stale (the
owner was killed): it is taken over with a warning. A lock from another host cannot be checked from here; delete it
by hand once that run is gone.

A folder that already holds ``checkpoint-*`` folders of an earlier run, or a finished run's LoRA (a run saved with
``save_strategy="no"``), is refused unless the run resumes from one (``resume_from_checkpoint``) or
``overwrite_output_dir=True`` says to write over it (the semantics of transformers' example scripts).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .artifacts import EXPORT_CONFIG_FILE, LOCK_FILE, LORA_FILE

logger = logging.getLogger(__name__)


class OutputDirLockedError(RuntimeError):
    """Another run holds the output directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


class OutputDirLock:
    """The lock of one ``output_dir`` (see the module docstring); ``acquire`` / ``release`` or a ``with`` block."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._handle_existing()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
            self.held = True
            return
        raise OutputDirLockedError(f"Could not take the lock {self.path}: another run keeps creating it.")

    def _handle_existing(self) -> None:
        try:
            other = json.loads(self.path.read_text())
        except (OSError, ValueError):
            other = {}
        pid, host = other.get("pid"), other.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid):
            logger.warning("Taking over the stale lock %s of pid %s (no longer running on %s).", self.path, pid, host)
            self.path.unlink(missing_ok=True)
            return
        who = f"pid {pid} on host {host}, started {other.get('started')}" if other else "an unreadable lock"
        raise OutputDirLockedError(
            f"output_dir {str(self.path.parent)!r} is in use by another marble_trl run ({who}): two runs in one folder "
            f"would overwrite each other's checkpoints and LoRA. Wait for it to end, choose another output_dir, or, if "
            f"that run is gone (another host, a crashed machine), delete {self.path}."
        )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> OutputDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_not_overwriting(output_dir: str | os.PathLike, resuming: bool, overwrite: bool) -> None:
    """Refuse to start a fresh run in a folder holding an earlier run's checkpoints (see the module docstring)."""
    folder = Path(output_dir)
    if resuming or overwrite or not folder.is_dir():
        return
    checkpoints = sorted(p.name for p in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir())
    if not checkpoints and (folder / LORA_FILE).is_file() and (folder / EXPORT_CONFIG_FILE).is_file():
        raise FileExistsError(
            f"output_dir {str(folder)!r} already holds a finished run (its {LORA_FILE} and {EXPORT_CONFIG_FILE}): a "
            "new run would replace its LoRA. Write over it with overwrite_output_dir=True (--overwrite_output_dir "
            "true), or choose another output_dir."
        )
    if checkpoints:
        raise FileExistsError(
            f"output_dir {str(folder)!r} already holds checkpoints of an earlier run ({', '.join(checkpoints[:3])}"
            f"{', ...' if len(checkpoints) > 3 else ''}). Resume it with resume_from_checkpoint=True "
            "(--resume_from_checkpoint true), write over it with overwrite_output_dir=True, or choose another "
            "output_dir."
        )
