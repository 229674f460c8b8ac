"""What makes the suite's results independent of the machine, the shell that starts it, and the order of the tests.

Used by ``conftest.py``; tested in ``test_hermetic.py``.

- :func:`scrub_environment` (once, before anything imports huggingface_hub, datasets or accelerate): the machine's
  Hugging Face, accelerate and torch.distributed settings do not reach the tests. They would change what an
  in-process trainer computes (``ACCELERATE_MIXED_PRECISION``), what it logs (``ACCELERATE_LOG_LEVEL``), whether it
  tries to join a process group (``WORLD_SIZE``, ``MASTER_ADDR`` exported in a SLURM / torchrun shell), which token
  or endpoint a push uses, and which caches are read or written (``~/.cache/huggingface``). ``CI`` is left as it is:
  the suite must pass with and without it (TRL skips telemetry when it is set; transformers' loggers propagate).
- :func:`restored_process_state` (around every test): a test that changes the process environment, torch's thread
  count or the SIGINT / SIGTERM handlers does not change the next test (``torch.set_num_threads`` is process-wide;
  the ShapesBench runner sets it and keeps it, as a worker should).
- :func:`default_signal_handlers` (for tests that send themselves signals): Python's own handlers, whatever the test
  process inherited. A non-interactive shell starts background jobs (``cmd &``) with SIGINT ignored, and the
  library leaves an ignored signal ignored (docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
from collections.abc import Iterator, MutableMapping

SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Settings of the machine the suite must not inherit (the suite's own subprocesses are given what they need).
_DROPPED = re.compile(
    r"(ACCELERATE_|HF_|HUGGINGFACE_|TRANSFORMERS_|DIFFUSERS_|FSDP_|TORCHELASTIC_|OMPI_COMM_WORLD_|MV2_COMM_WORLD_).*"
    r"|RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|PMI_RANK|PMI_SIZE"
)
_LOOPBACK = ("127.0.0.1", "localhost")


def scrub_environment(env: MutableMapping[str, str] | None = None, hf_home: str | None = None) -> str:
    """Drop the machine's Hugging Face / accelerate / torch.distributed settings from ``env`` (``os.environ``), then
    set ``HF_HOME`` to ``hf_home`` (a new temporary folder by default), ``HF_HUB_OFFLINE=1`` (the suite is offline by
    construction: accidental Hub access fails fast instead of retrying) and never proxy the loopback address (the
    local reward servers and the stand-in Hub). Returns ``HF_HOME``."""
    env = os.environ if env is None else env
    for name in [n for n in env if _DROPPED.fullmatch(n)]:
        del env[name]
    hf_home = hf_home or tempfile.mkdtemp(prefix="marble-trl-tests-hf-home-")
    env["HF_HOME"] = hf_home
    env["HF_HUB_OFFLINE"] = "1"
    for name in ("NO_PROXY", "no_proxy"):
        hosts = [h for h in env.get(name, "").split(",") if h.strip()]
        env[name] = ",".join([*hosts, *(h for h in _LOOPBACK if h not in hosts)])
    return hf_home


def _set_handlers(handlers: dict) -> None:
    for signum, handler in handlers.items():
        if handler is not None and signal.getsignal(signum) is not handler:  # None: installed outside Python
            signal.signal(signum, handler)


@contextlib.contextmanager
def restored_process_state() -> Iterator[None]:
    """On exit, put back ``os.environ``, torch's intra-op thread count and the SIGINT / SIGTERM handlers."""
    import torch

    env, threads = dict(os.environ), torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        yield
    finally:
        if dict(os.environ) != env:
            os.environ.clear()
            os.environ.update(env)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        _set_handlers(handlers)


@contextlib.contextmanager
def default_signal_handlers() -> Iterator[None]:
    """Python's default handlers while inside (SIGINT raises ``KeyboardInterrupt``, SIGTERM terminates); the
    previous ones afterwards. Subprocesses started inside inherit the default dispositions too."""
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        _set_handlers(previous)
