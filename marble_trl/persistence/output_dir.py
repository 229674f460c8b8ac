"""One run per ``output_dir``: a lock file held while ``train()`` runs, and no silent overwrite of an earlier run.

``<output_dir>/.marble_trl.lock`` holds the owner's pid, host, start time, scheduler job id (Slurm, PBS, LSF, SGE) and
lease; it is created atomically (``O_CREAT | O_EXCL``) by the main process when training starts and removed when it
ends, also on errors. While it is held a heartbeat thread touches it every third of the lease (default 10 minutes). A
second run on the same folder fails at start naming the owner, unless the lock is stale:

- its pid no longer runs on this host (the owner was killed);
- it belongs to the same scheduler job (a requeued job restarting on another node);
- its heartbeat is older than its lease (the owner's host died or the owner hangs: a live owner touches it);

then it is taken over with a warning. ``take_over_lock=True`` (``--take_over_lock true``) takes over any lock, for an
owner you know is gone before its lease expires.

A folder that already holds ``checkpoint-*`` folders of an earlier run, or a finished run's LoRA (a run saved with
``save_strategy="no"``), is refused unless the run resumes from one (``resume_from_checkpoint``) or
``overwrite_output_dir=True`` says to write over it (the semantics of transformers' example scripts).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..artifacts import EXPORT_CONFIG_FILE, LOCK_FILE, LORA_FILE, TRANSFORMER_DIR
from .full_weights import is_full_finetune

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


LEASE_S = 600.0  # a live owner touches its lock every LEASE_S / 3 seconds
JOB_ID_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID")


def scheduler_job_id() -> str | None:
    """The batch scheduler's job id of this process (a requeued job keeps it), or None."""
    for name in JOB_ID_VARIABLES:
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return None


class OutputDirLock:
    """The lock of one ``output_dir`` (see the module docstring); ``acquire`` / ``release`` or a ``with`` block."""

    def __init__(self, output_dir: str | os.PathLike, lease_s: float = LEASE_S, take_over: bool = False) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.lease_s, self.take_over = float(lease_s), take_over
        self.held = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "job": scheduler_job_id(),
            "lease_s": self.lease_s,
        }
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._handle_existing()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
            self.held = True
            self._start_heartbeat()
            return
        raise OutputDirLockedError(f"Could not take the lock {self.path}: another run keeps creating it.")

    def _start_heartbeat(self) -> None:
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(self.lease_s / 3):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._heartbeat = threading.Thread(target=beat, name="marble-trl-lock-heartbeat", daemon=True)
        self._heartbeat.start()

    def _handle_existing(self) -> None:
        try:
            other = json.loads(self.path.read_text())
            age = time.time() - self.path.stat().st_mtime
        except (OSError, ValueError):
            other, age = {}, 0.0
        pid, host, job = other.get("pid"), other.get("host"), other.get("job")
        lease = float(other.get("lease_s") or self.lease_s)
        stale = None
        if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() and not _pid_alive(pid):
            stale = f"pid {pid} no longer runs on {host}"
        elif job is not None and job == scheduler_job_id():
            stale = f"it belongs to this scheduler job ({job}): a requeued run"
        elif other and age > lease:
            stale = f"its heartbeat is {age:.0f} s old (lease {lease:.0f} s): the owner on {host} is gone or hangs"
        elif self.take_over:
            stale = "take_over_lock=True"
        if stale is not None:
            logger.warning("Taking over the lock %s of pid %s on %s: %s.", self.path, pid, host, stale)
            self.path.unlink(missing_ok=True)
            return
        who = f"pid {pid} on host {host}, started {other.get('started')}" if other else "an unreadable lock"
        raise OutputDirLockedError(
            f"output_dir {str(self.path.parent)!r} is in use by another marble_trl run ({who}; its heartbeat is "
            f"{age:.0f} s old, lease {lease:.0f} s): two runs in one folder would overwrite each other's checkpoints "
            "and LoRA. Wait for it to end, choose another output_dir, or, if that run is gone, wait for its lease to "
            f"expire or take the lock over with take_over_lock=True (--take_over_lock true)."
        )

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None
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
    name = LORA_FILE if (folder / LORA_FILE).is_file() else TRANSFORMER_DIR if is_full_finetune(folder) else None
    if not checkpoints and name and (folder / EXPORT_CONFIG_FILE).is_file():  # a LoRA, or a full fine-tune's folder
        raise FileExistsError(
            f"output_dir {str(folder)!r} already holds a finished run (its {name} and {EXPORT_CONFIG_FILE}): a "
            "new run would replace its weights. Write over it with overwrite_output_dir=True (--overwrite_output_dir "
            "true), or choose another output_dir."
        )
    if checkpoints:
        raise FileExistsError(
            f"output_dir {str(folder)!r} already holds checkpoints of an earlier run ({', '.join(checkpoints[:3])}"
            f"{', ...' if len(checkpoints) > 3 else ''}). Resume it with resume_from_checkpoint=True "
            "(--resume_from_checkpoint true), write over it with overwrite_output_dir=True, or choose another "
            "output_dir."
        )
