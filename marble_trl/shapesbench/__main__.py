"""Command line of ShapesBench: ``python -m marble_trl.shapesbench {pretrain,run,report}``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

DEFAULT_OUT = "outputs/shapesbench"


def _add_dataclass_args(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    for f in fields(cls):
        flag = "--" + prefix + f.name.replace("_", "-")
        parser.add_argument(flag, dest=prefix.replace("-", "_") + f.name, type=type(f.default), default=None)


def _from_args(cls, ns: argparse.Namespace, prefix: str = ""):
    values = {f.name: getattr(ns, prefix.replace("-", "_") + f.name) for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if v is not None})


def main(argv: list[str] | None = None) -> None:
    from .bench import Budget
    from .pretrain import PretrainConfig

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        from .bench import worker_main

        worker_main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m marble_trl.shapesbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pretrain", help="build (or find in the cache) the base model; prints its folder")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    _add_dataclass_args(p, PretrainConfig, "pretrain-")
    r = sub.add_parser("run", help="pretrain if needed, run every method x seed, write tables and plots")
    r.add_argument("--out", default=DEFAULT_OUT)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--methods", nargs="+", default=None, help="default: all")
    r.add_argument("--jobs", type=int, default=2, help="runs at once, one subprocess each (0: in this process)")
    r.add_argument("--model", default=None, help="a pretrained pipeline folder (default: the cached base model)")
    r.add_argument("--skip-existing", action="store_true", help="keep run records already in --out")
    _add_dataclass_args(r, Budget)
    _add_dataclass_args(r, PretrainConfig, "pretrain-")
    shipping = [
        sub.add_parser(
            "ship", help="build the base model and the judges and copy them into the package (MANIFEST.json)"
        ),
        sub.add_parser("verify-shipped", help="rebuild the shipped weights from scratch and compare them bit for bit"),
    ]
    for p in shipping:
        p.add_argument("--jobs", type=int, default=2, help="2: the base model and the judges train at once")
    con = sub.add_parser("confirm", help="the pre-registered confirmatory tables and verdicts from --out's records")
    con.add_argument("--out", default=DEFAULT_OUT)
    rep = sub.add_parser("report", help="(re)write the tables and plots from the run records in --out")
    rep.add_argument("--out", default=DEFAULT_OUT)
    rep.add_argument(
        "--rescore", action="store_true", help="first add held-out rewards the run records lack, from saved images"
    )
    args = parser.parse_args(argv)

    from .report import write_report

    if args.command == "confirm":
        from .confirm import report as confirm_report

        print(confirm_report(args.out))
        return
    if args.command == "ship":
        from .ship import ship

        print(ship(jobs=args.jobs))
        return
    if args.command == "verify-shipped":
        from .ship import verify_shipped

        differ = verify_shipped(jobs=args.jobs)
        if not differ:
            print("shipped weights reproduced bit for bit")
        for name, diff in differ.items():
            print(
                f"{name}: differs from MANIFEST.json; largest tensor difference {diff:.1e} of the tensor's scale "
                "(bit for bit needs the same torch build and CPU kernels: docs/shapesbench.md#limitations)"
            )
        sys.exit(1 if differ else 0)
    if args.command == "pretrain":
        from .pretrain import pretrain

        print(pretrain(_from_args(PretrainConfig, args, "pretrain-"), force=args.force))
    elif args.command == "run":
        from .bench import run_benchmark
        from .shipped import base_model

        model = args.model or str(base_model(_from_args(PretrainConfig, args, "pretrain-")))
        run_benchmark(
            model,
            args.out,
            methods=args.methods,
            seeds=args.seeds,
            budget=_from_args(Budget, args),
            jobs=args.jobs,
            skip_existing=args.skip_existing,
        )
        print(write_report(args.out))
        print(f"tables and plots in {Path(args.out).resolve()}")
    else:
        if args.rescore:
            from .bench import rescore

            print(f"rescored: {rescore(args.out) or 'nothing to add'}")
        print(write_report(args.out))


if __name__ == "__main__":
    main()
