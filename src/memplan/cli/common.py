"""What the subcommands share: the console, one-line errors, the MODEL argument's help."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from memplan.errors import bad_arg

MODEL_HELP = ("a built-in workload 'resnet:depth=1000,batch=32', 'lstm:steps=1024', "
              "'gpt:layers=12', or a factory 'package.module:callable' returning "
              "(model, example_inputs[, loss_fn])")


def wide_console() -> Console:
    """A console; 120 columns when writing to a pipe or log (rich's default there is 80)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def check_writable(out: str, arg: str) -> None:
    """Fail before the work, not after it: ``out`` must be a file in an existing folder."""
    parent = Path(out).resolve().parent
    if not parent.is_dir():
        raise bad_arg(arg, "a file in an existing directory", out,
                      f"Create {parent} first or write the file elsewhere.")
    if Path(out).is_dir():
        raise bad_arg(arg, "a file path, not a directory", out, "Name a file, e.g. plan.json.")
