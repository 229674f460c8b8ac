"""Shared fixtures: the tiny offline SD3 pipeline (built once per session; tests must not mutate it)."""

from __future__ import annotations

import os

import pytest

# The suite is offline by construction; make any accidental Hub access fail fast instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_pipeline():
    from marble_trl.models import build_tiny_sd3_pipeline

    return build_tiny_sd3_pipeline(seed=0)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """An uninterrupted 6-step MARBLE run with checkpoints at steps 3 and 6 (see tests/marble_runs.py)."""
    from marble_runs import run_reference

    return run_reference(tmp_path_factory.mktemp("reference-run"))
