"""Shared fixtures: the tiny offline SD3 pipeline (built once per session; tests must not mutate it), and a test
environment that does not depend on the machine or the shell (see hermetic.py)."""

from __future__ import annotations

import shutil

import pytest
from hermetic import default_signal_handlers, restored_process_state, scrub_environment

# Before any test module imports huggingface_hub / datasets / accelerate (they read these at import time).
_HF_HOME = scrub_environment()


def pytest_unconfigure(config):
    shutil.rmtree(_HF_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restored_process_state():
    """Environment variables, torch's thread count and the SIGINT / SIGTERM handlers as they were before the test."""
    with restored_process_state():
        yield


@pytest.fixture
def default_signals():
    """Python's default SIGINT / SIGTERM handlers, also when the suite was started with SIGINT ignored (``cmd &``)."""
    with default_signal_handlers():
        yield


@pytest.fixture(scope="session")
def tiny_pipeline():
    from marble_trl.models import build_tiny_sd3_pipeline

    return build_tiny_sd3_pipeline(seed=0)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """An uninterrupted 6-step MARBLE run with checkpoints at steps 3 and 6 (see tests/marble_runs.py)."""
    from marble_runs import run_reference

    return run_reference(tmp_path_factory.mktemp("reference-run"))
