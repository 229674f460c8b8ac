"""Shared fixtures: the tiny offline SD3 pipeline (built once per session; tests must not mutate it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pipeline():
    from marble_trl.models import build_tiny_sd3_pipeline

    return build_tiny_sd3_pipeline(seed=0)
