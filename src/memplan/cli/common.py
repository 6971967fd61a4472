"""What the subcommands share: the console, one-line errors, checked flag values, and output
paths that are checked before the work and never lose its result after it."""

from __future__ import annotations

import argparse
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from memplan.core.plan_schema import printable
from memplan.errors import ConfigError, bad_arg

MODEL_HELP = ("a built-in workload 'resnet:depth=1000,batch=32', 'lstm:steps=1024', "
              "'gpt:layers=12', or a factory 'package.module:callable' or "
              "'path/to/file.py:callable' returning (model, example_inputs[, loss_fn])")
MAX_BATCH = 2**31 - 1
MAX_JOBS = 256  # worker processes
MAX_REPEAT = 1000  # timed rounds
MAX_ERROR_CHARS = 2000


def wide_console(markup: bool = False) -> Console:
    """A console; 120 columns when writing to a pipe or log (rich's default there is 80).
    No markup by default and no emoji codes ever: module names, paths and specs print as they
    are ("[red]" and ":llama:" too; a factory 'pkg:llama' titles a table 'pkg:llama: ...')."""
    console = Console(markup=markup, emoji=False, highlight=False)
    return console if console.is_terminal else Console(width=120, markup=markup, emoji=False,
                                                       highlight=False)


def one_line(err: BaseException | str) -> str:
    """A message on one line, control characters escaped, at most MAX_ERROR_CHARS long."""
    text = printable(" ".join(str(err).split()))
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def int_in(lo: int, hi: int, example: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [lo, hi] (argparse reports the message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer in [{lo}, {hi}], got {text!r}; e.g. {example}") from None
        if not lo <= value <= hi:
            shown = text if len(text) < 30 else f"a {len(text)}-digit number"
            raise argparse.ArgumentTypeError(
                f"expected an integer in [{lo}, {hi}], got {shown}; e.g. {example}")
        return value
    return parse


def check_writable(out: str, arg: str) -> None:
    """Fail before the work, not after it: ``out`` must be a regular file (new or existing) in
    a folder where a file can be created."""
    path = Path(out)
    parent = path.resolve().parent
    if not parent.is_dir():
        raise bad_arg(arg, "a file in an existing directory", out,
                      f"Create {printable(str(parent))} first or write the file elsewhere.")
    if path.is_dir():
        raise bad_arg(arg, "a file path, not a directory", out, "Name a file, e.g. plan.json.")
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        raise bad_arg(arg, "a regular file (it is replaced)", out,
                      "Name a file, e.g. plan.json; to read a plan, use memplan explain FILE.")
    _probe(parent, arg, out)


def check_folder(out: Path, arg: str) -> None:
    """Fail before the work: ``out`` is a folder (created if missing) where files can be
    written."""
    if out.exists() and not out.is_dir():
        raise bad_arg(arg, "a folder", str(out), "Name a folder (it is created if missing).")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise bad_arg(arg, "a folder that can be created", str(out),
                      f"{err.strerror}: name another folder.") from None
    _probe(out, arg, str(out))


def _probe(folder: Path, arg: str, shown: str) -> None:
    """Create and remove a file in ``folder``: what permissions, read-only mounts and full
    disks allow, not what the mode bits say (root passes every access() check)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".memplan-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise bad_arg(arg, "a path memplan can write", shown,
                      f"{err.strerror} in {printable(str(folder))}: write elsewhere.") from None


def write_result(path: str, text: str, arg: str, what: str) -> None:
    """Write ``text`` to ``path`` (a temporary file, then renamed: no half-written file).
    If that fails after the work, the result is not lost: it is saved in the temporary
    folder and the error names that file."""
    target = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.resolve().parent, prefix=".memplan-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o666 & ~_umask())  # as open() would make it (mkstemp: 0600)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        saved = _save_elsewhere(text, target.suffix)
        where = (f"the {what} was saved to {saved} instead" if saved
                 else f"the {what} could not be saved anywhere (the temporary folder failed too)")
        raise ConfigError(f"{arg}: could not write {printable(path)} ({err.strerror}); "
                          f"{where}.") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _save_elsewhere(text: str, suffix: str) -> str | None:
    try:
        fd, name = tempfile.mkstemp(prefix="memplan-", suffix=suffix or ".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:
        return None
    return name
