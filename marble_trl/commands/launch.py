"""``marble-trl train ... --accelerate_config FILE [--num_processes N]``: re-run the command under ``accelerate launch``.

The same convenience as ``trl <command> --accelerate_config``: the launcher flags are taken out of the training
arguments, and the process re-executes itself as
``python -m accelerate.commands.launch --config_file FILE [--num_processes N] -m marble_trl.cli train <the rest>``.
Anything ``accelerate launch`` supports beyond these two flags (``--machine_rank``, ``--main_process_ip``, ...) is
used by calling ``accelerate launch`` directly (see ``docs/distributed.md``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

LAUNCH_FLAGS = ("--accelerate_config", "--num_processes")


def split_launch_args(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Take ``--accelerate_config X`` / ``--num_processes N`` (also ``--flag=value``, and ``-`` for ``_``) out of
    ``argv``; return them (``{"accelerate_config": ..., "num_processes": ...}``, only those given) and the rest."""
    found: dict[str, str] = {}
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        key = name.replace("-", "_").lstrip("_")
        if name.startswith("--") and "--" + key in LAUNCH_FLAGS:
            if not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise ValueError(f"{name} needs a value.")
                value = args[i + 1]
                i += 1
            if key in found:
                raise ValueError(f"{name} given twice.")
            found[key] = value
        else:
            rest.append(arg)
        i += 1
    if "num_processes" in found:
        try:
            n = int(found["num_processes"])
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--num_processes must be a positive integer, got {found['num_processes']!r}.")
    if "accelerate_config" in found and not os.path.isfile(found["accelerate_config"]):
        raise FileNotFoundError(
            f"--accelerate_config {found['accelerate_config']!r} is not a file (configs ship in recipes/accelerate/)."
        )
    return found, rest


def build_launch_command(
    train_argv: Sequence[str], accelerate_config: str | None = None, num_processes: int | str | None = None
) -> list[str]:
    """The ``accelerate launch`` command line that runs ``marble-trl train <train_argv>``."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if accelerate_config is not None:
        cmd += ["--config_file", str(accelerate_config)]
    if num_processes is not None:
        cmd += ["--num_processes", str(int(num_processes))]
    return cmd + ["-m", "marble_trl.cli", "train", *train_argv]


def launch_train(launch: dict[str, str], train_argv: Sequence[str]) -> int:
    """Run ``marble-trl train`` under ``accelerate launch``; returns its exit code."""
    cmd = build_launch_command(train_argv, launch.get("accelerate_config"), launch.get("num_processes"))
    print("[marble-trl] " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)
