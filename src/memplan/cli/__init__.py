"""The ``memplan`` command line: argparse and the console only, the work is done below.

Each subcommand is one module of this package with ``add_parser(sub)``, which sets its
``run(args) -> exit code``; modules import the heavy layers (torch) inside ``run``, so that
``memplan --help`` stays fast. Errors end with one line and exit code 2 (``--debug`` shows the
traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from memplan.cli import bench, demo, explain, measure, plan, reproduce, verify
from memplan.cli.common import one_line
from memplan.errors import MemplanError

COMMANDS = (demo, measure, plan, explain, verify, bench, reproduce)


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
        print(f"memplan: error: {one_line(err)}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memplan", description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
