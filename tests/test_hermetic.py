"""The suite's isolation from the machine and the shell (hermetic.py, used by conftest.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from hermetic import default_signal_handlers, restored_process_state, scrub_environment


def test_scrub_environment_drops_the_machines_settings(tmp_path):
    env = {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_LOG_LEVEL": "error",
        "HF_TOKEN": "hf_real_token",
        "HF_DATASETS_CACHE": "/somewhere",
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_VERBOSITY": "error",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.1",
        "RANKING": "kept",  # only whole names / prefixes are dropped
        "CI": "true",
        "PATH": "/usr/bin",
        "no_proxy": "intranet.example",
    }
    assert scrub_environment(env, hf_home=str(tmp_path)) == str(tmp_path)
    assert env == {
        "RANKING": "kept",
        "CI": "true",
        "PATH": "/usr/bin",
        "HF_HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "intranet.example,127.0.0.1,localhost",
    }


def test_this_session_reads_no_home_cache():
    """conftest.py scrubbed the environment before huggingface_hub was imported: its constants follow."""
    from huggingface_hub import constants

    home = Path(os.environ["HF_HOME"])
    assert home.is_dir() and home != Path.home() / ".cache" / "huggingface"
    assert Path(constants.HF_HOME) == home and Path(constants.HF_HUB_CACHE).is_relative_to(home)
    assert constants.HF_HUB_OFFLINE
    assert not [name for name in os.environ if name.startswith("ACCELERATE_")]


def test_restored_process_state_undoes_environment_threads_and_signals():
    env, threads = dict(os.environ), torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with restored_process_state():
        os.environ["MARBLE_TRL_TEST_LEAK"] = "1"
        os.environ.pop("PATH", None)
        torch.set_num_threads(threads + 1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: None)
    assert dict(os.environ) == env and torch.get_num_threads() == threads
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_default_signal_handlers_override_an_inherited_sig_ign():
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job; restored by the autouse fixture
    with default_signal_handlers():
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    signal.signal(signal.SIGINT, previous)
