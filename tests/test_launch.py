"""`marble-trl train --accelerate_config FILE [--num_processes N]` re-runs itself under `accelerate launch`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from marble_trl.cli import main
from marble_trl.commands import launch

ROOT = Path(__file__).resolve().parents[1]
MULTI_GPU = str(ROOT / "recipes" / "accelerate" / "multi_gpu.yaml")
RECIPE = str(ROOT / "recipes" / "tiny-random.yaml")


def test_split_launch_args_takes_out_only_the_launcher_flags():
    found, rest = launch.split_launch_args(
        ["--config", RECIPE, "--accelerate_config", MULTI_GPU, "--max_steps", "3", "--num-processes=2"]
    )
    assert found == {"accelerate_config": MULTI_GPU, "num_processes": "2"}
    assert rest == ["--config", RECIPE, "--max_steps", "3"]
    assert launch.split_launch_args(["--config", RECIPE]) == ({}, ["--config", RECIPE])
    assert launch.split_launch_args([f"--accelerate_config={MULTI_GPU}"])[0] == {"accelerate_config": MULTI_GPU}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--accelerate_config"], "needs a value"),
        (["--accelerate_config", "--max_steps", "3"], "needs a value"),
        (["--num_processes", "0"], "positive integer"),
        (["--num_processes", "two"], "positive integer"),
        (["--num_processes", "2", "--num_processes", "4"], "given twice"),
    ],
)
def test_split_launch_args_rejects_bad_values(argv, message):
    with pytest.raises(ValueError, match=message):
        launch.split_launch_args(argv)


def test_missing_accelerate_config_is_an_error():
    with pytest.raises(FileNotFoundError, match="not a file"):
        launch.split_launch_args(["--accelerate_config", "recipes/accelerate/nope.yaml"])


def test_build_launch_command():
    cmd = launch.build_launch_command(["--config", RECIPE, "--max_steps", "3"], MULTI_GPU, "2")
    assert cmd == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        MULTI_GPU,
        "--num_processes",
        "2",
        "-m",
        "marble_trl.cli",
        "train",
        "--config",
        RECIPE,
        "--max_steps",
        "3",
    ]
    assert launch.build_launch_command([], None, None) == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "-m",
        "marble_trl.cli",
        "train",
    ]


def test_train_command_reexecutes_under_accelerate(monkeypatch):
    calls = []
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd: calls.append(cmd) or 7)
    code = main(["train", "--config", RECIPE, "--accelerate_config", MULTI_GPU, "--num_processes", "2", "--seed", "1"])
    assert code == 7  # the launched run's exit code
    (cmd,) = calls
    assert cmd[1:7] == ["-m", "accelerate.commands.launch", "--config_file", MULTI_GPU, "--num_processes", "2"]
    assert cmd[7:] == ["-m", "marble_trl.cli", "train", "--config", RECIPE, "--seed", "1"]
