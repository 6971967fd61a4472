"""The ``memplan`` command line. Errors end with one line and exit code 2 (``--debug`` shows
the traceback)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from memplan.errors import MemplanError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        result: int = args.run(args)
        return result
    except MemplanError as err:
        if args.debug:
            raise
        print(f"memplan: error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memplan", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="the headline: paper-scale memory of plain training")
    demo.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    demo.set_defaults(run=_demo)

    meas = sub.add_parser("measure", help="peak memory of one training step")
    meas.add_argument("model", help="e.g. resnet:depth=1000,batch=32 or lstm:steps=1024")
    meas.add_argument("--real", action="store_true", help="run for real instead of simulating")
    meas.add_argument("--device", default="cpu", help="cpu or cuda (with --real)")
    meas.set_defaults(run=_measure)
    return parser


def _measure(args: argparse.Namespace) -> int:
    from memplan.measure import measure
    from memplan.spec import parse_spec

    report = measure(parse_spec(args.model), simulate=not args.real, device=args.device)
    print(report.summary())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from memplan.demo import run_demo

    start = time.perf_counter()
    run_demo(jobs=args.jobs)
    print(f"\ndemo finished in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
