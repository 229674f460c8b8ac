"""``marble-trl check --config RECIPE [--num_processes N] [--accelerate_config FILE] [--gpu_memory 80GB] [--measure]
[any train override]``: a preflight that answers in seconds, offline, before GPU hours are spent (docs/check.md).

The recipe is parsed by ``marble-trl train``'s own parser and config checks (several errors are collected: each field
in error is dropped and the parse repeated); the model family is resolved without weights and its transformer built
on the meta device; LoRA targets, resolution, token limit and rollout solvers are checked against it; the rewards
resolve, import and find their weights and their prompts; the batching is the trainer's own arithmetic at the
launcher's process count; memory per GPU is estimated for the strategy of the accelerate config and compared with
the GPU. Exit code 1 with the list of fixes when anything is an error, 0 with the verdict and the tables otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from ..preflight.report import Report


def check_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marble-trl check",
        description="Preflight a training recipe: config, model family, LoRA, rewards, batching and memory per GPU. "
        "Takes marble-trl train's arguments (--config, any field override, --accelerate_config, --num_processes).",
        allow_abbrev=False,
    )
    p.add_argument("--gpu_memory", metavar="SIZE", help="Memory of one GPU, e.g. 80GB or 24GiB (default: this "
                   "machine's first GPU, if any).")  # fmt: skip
    p.add_argument("--measure", action="store_true", help="With a GPU here: run one real micro-batch and extrapolate "
                   "the step and run time (loads the weights). Skipped on a CPU.")  # fmt: skip
    return p


def check_command(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        check_parser().print_help()
        return 0
    report = run_check(argv)
    print("\n".join(report.lines()))
    return report.exit_code


def run_check(argv: list[str]) -> Report:
    """The whole preflight of ``argv`` (``marble-trl check``'s arguments), as a :class:`Report`."""
    from ..preflight.memory import strategy_from_accelerate
    from .launch import split_launch_args

    report = Report()
    own, train_argv = check_parser().parse_known_args(argv)
    try:
        launch, train_argv = split_launch_args(train_argv)
    except (ValueError, FileNotFoundError) as err:
        report.error("launch", str(err), "give --accelerate_config an existing file (recipes/accelerate/)")
        return report
    n = int(launch["num_processes"]) if "num_processes" in launch else None
    config_file = launch.get("accelerate_config")
    try:
        strategy = strategy_from_accelerate(config_file, n)
    except (ValueError, OSError) as err:
        report.error("launch", str(err), "use one of recipes/accelerate/*.yaml")
        return report
    parsed = parse_like_train(train_argv, strategy.processes, report)
    if parsed is None:
        return report
    if parsed.args.use_cpu:
        strategy = strategy_from_accelerate(None, strategy.processes, use_cpu=True)
    from ..preflight.run import run_checks

    run_checks(parsed, strategy, own.gpu_memory, own.measure, report)
    return report


def _config_path(argv: list[str]) -> tuple[int, str, str] | None:
    """``(index, path, prefix)`` of the recipe in ``argv``: ``argv[index] == prefix + path``."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return i + 1, argv[i + 1], ""
        if arg.startswith("--config="):
            return i, arg.split("=", 1)[1], "--config="
    return None


def _user_keys(argv: list[str], yaml_keys: set[str]) -> set[str]:
    flags = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}
    return (flags | yaml_keys) - {"config"}


def _drop(argv: list[str], keys: set[str]) -> list[str]:
    """``argv`` without the overrides of ``keys`` (``--key value`` / ``--key=value`` / list values)."""
    out, skipping = [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg[2:].split("=", 1)[0].replace("-", "_") in keys
            if skipping:
                continue
        elif skipping:
            continue
        out.append(arg)
    return out


@contextlib.contextmanager
def _world_size(n: int):
    """The config class believes it runs on ``n`` processes while it is parsed (its batching check reads
    ``world_size``), as the launched run will."""
    from ..nft_config import MarbleDiffusionNFTConfig

    own = vars(MarbleDiffusionNFTConfig).get("world_size")
    MarbleDiffusionNFTConfig.world_size = property(lambda self: n)
    try:
        yield
    finally:
        if own is None:
            del MarbleDiffusionNFTConfig.world_size
        else:
            MarbleDiffusionNFTConfig.world_size = own


def parse_like_train(argv: list[str], world_size: int, report: Report, attempts: int = 12) -> SimpleNamespace | None:
    """``marble-trl train``'s parser (:func:`marble_trl.commands.train.train_parser`) on ``argv`` at ``world_size``
    processes. Each error is reported; the fields it names are dropped (their defaults used) and the parse repeated,
    so several errors come out at once. Returns ``script_args``, ``args`` (the training config), ``bf16`` (requested),
    ``dropped`` (fields in error) and ``raw`` (the recipe's values with the overrides given as text), or ``None``.

    bf16 on a machine without a GPU is not an error of the recipe (it runs on GPUs): it is parsed as False here and
    remembered for the memory estimate."""
    import torch
    import yaml

    from .train import train_parser

    argv = list(argv)
    found = _config_path(argv)
    raw: dict = {}
    if found is not None:
        try:
            raw = yaml.safe_load(Path(found[1]).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            report.error("config", f"--config {found[1]}: {err}", "give an existing YAML recipe (recipes/*.yaml)")
            return None
    keys = _user_keys(argv, set(raw))
    given = dict(raw, **_overrides(argv))
    bf16 = None
    dropped: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="marble-check-") as tmp:
        for _ in range(attempts):
            stderr = io.StringIO()
            try:
                with _world_size(world_size), contextlib.redirect_stderr(stderr):
                    script_args, args = train_parser().parse_args_and_config(args=argv)
                requested = bool(args.bf16) if bf16 is None else bf16
                return SimpleNamespace(script_args=script_args, args=args, bf16=requested, dropped=dropped, raw=given)
            except SystemExit:
                lines = [ln for ln in stderr.getvalue().splitlines() if "error:" in ln]
                message = lines[-1].split("error:", 1)[1].strip() if lines else "the arguments could not be parsed"
            except (ValueError, TypeError, FileNotFoundError) as err:
                message = str(err)
            if "bf16" in message and "gpu" in message.lower() and not torch.cuda.is_available() and bf16 is None:
                argv, bf16 = argv + ["--bf16", "false"], True
                continue
            named = {k for k in keys - dropped if re.search(rf"(?<![\w]){re.escape(k)}(?![\w])", message)}
            if _BATCHING in message or "not a multiple of num_generations" in message:
                named &= {"per_device_train_batch_size"}  # the micro-batch; the batching table lists valid ones
            report.error("config", message, _config_fix(message, named))
            if not named:
                if dropped:
                    report.note("config", "more config errors may hide behind this one: fix it and check again.")
                return None
            dropped |= named
            argv = _drop(argv, named)
            if found is not None and named & set(raw):
                raw = {k: v for k, v in raw.items() if k not in named}
                path = Path(tmp) / f"recipe-{len(dropped)}.yaml"
                path.write_text(yaml.safe_dump(raw))
                index, _, prefix = _config_path(argv)
                argv[index] = prefix + str(path)
    return None


def _overrides(argv: list[str]) -> dict[str, str]:
    """``--key value`` pairs of the command line (the value as text; lists joined by spaces)."""
    out: dict[str, list[str]] = {}
    key = None
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            key = name.replace("-", "_")
            out[key] = [value] if eq else []
            if eq:
                key = None
        elif key is not None:
            out[key].append(arg)
    return {k: " ".join(v) for k, v in out.items() if k != "config"}


_BATCHING = "cannot be split into micro-batches"


def _config_fix(message: str, named: set[str]) -> str:
    if "sample_scheduler" in message and "Choose one of" in message:
        field_name = "eval_sample_scheduler" if "eval_sample_scheduler=" in message else "sample_scheduler"
        return f"set --{field_name} dpm2 (or euler, heun, ...: the names the error lists)"
    if _BATCHING in message or "not a multiple of num_generations" in message:
        return "choose a per_device_train_batch_size and a process count that split the step into whole groups"
    if named:
        return f"fix {', '.join(sorted(named))} as the error says"
    return "fix the config as the error says"


if __name__ == "__main__":  # python -m marble_trl.commands.check
    raise SystemExit(check_command(sys.argv[1:]))
