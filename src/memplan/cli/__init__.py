"""The ``memplan`` command line: argparse and the console only, the work is done below.

Each subcommand is one module of this package with ``add_parser(sub)``, which sets its
``run(args) -> exit code``; modules import the heavy layers (torch) inside ``run``, so that
``memplan --help`` stays fast. Every error ends the same way: one line on stderr starting
``memplan: error:``, exit code 2, no traceback (``--debug``, before or after the command,
shows it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from memplan.cli import bench, demo, explain, measure, plan, reproduce, verify
from memplan.cli.common import one_line
from memplan.errors import MemplanError

COMMANDS = (demo, measure, plan, explain, verify, bench, reproduce)
DEBUG_HELP = "show the traceback of an error"


class UsageError(Exception):
    """A command line argparse refused (its message, on one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage + error; we say one line
        raise UsageError(f"{message} (see: {self.prog} --help)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        return _error(one_line(err))
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    if args.command is None:
        names = ", ".join(c.__name__.rpartition(".")[2] for c in COMMANDS)
        return _error(f"a command is required, one of {names} (see: memplan --help)")
    try:
        result: int = args.run(args)
        return result
    except MemplanError as err:
        if args.debug:
            raise
        return _error(one_line(err))
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("memplan: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exit_:  # raised by code memplan ran for the user: a factory, a model
        if args.debug:
            raise
        return _error(f"the model's code called sys.exit({one_line(repr(exit_.code))}) while "
                      f"memplan ran it; memplan stops here (rerun with --debug for where).")
    except Exception as err:  # what no check above caught: still one line
        if args.debug:
            raise
        return _error(f"{type(err).__name__}: {one_line(err)} (an error memplan does not check "
                      "for; rerun with --debug for the traceback)")


def _error(message: str) -> int:
    print(f"memplan: error: {message}", file=sys.stderr)
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memplan", description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    for p in sub.choices.values():  # --debug after the command too
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=DEBUG_HELP)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
