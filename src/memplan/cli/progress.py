"""A live status line while memplan captures a step: what runs, for how long, and how many
module calls the model's forward has made so far. Shown on a terminal only (rich draws
nothing on a pipe); the library itself stays quiet."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text


class _Calls(ProgressColumn):
    """Module calls counted so far (the fake forward of capture runs them one by one)."""

    def __init__(self, calls: list[int]) -> None:
        super().__init__()
        self.calls = calls

    def render(self, task: Any) -> Text:
        return Text(f"module calls: {self.calls[0]:,}" if self.calls[0] else "")


@contextlib.contextmanager
def working(console: Console, what: str, count_calls: bool = True
            ) -> Iterator[Callable[[str], None]]:
    """Show ``what`` with a spinner, elapsed time and (``count_calls``) the module calls so
    far, until the block ends; yields a function that changes the text. Counting uses a
    global forward hook that returns nothing: the step it watches is unchanged."""
    import torch

    if not console.is_terminal:  # a pipe or a log: no live line (rich would leave a blank one)
        yield lambda text: None
        return
    calls = [0]

    def count(module: Any, args: Any, output: Any) -> None:
        calls[0] += 1

    # The counters first: a narrow terminal cuts the text, not them.
    columns: list[ProgressColumn] = [SpinnerColumn(), TimeElapsedColumn()]
    if count_calls:
        columns.append(_Calls(calls))
    columns.append(TextColumn("{task.description}", markup=False))
    progress = Progress(*columns, console=console, transient=True)
    handle = torch.nn.modules.module.register_module_forward_hook(count) if count_calls else None
    try:
        with progress:
            task = progress.add_task(what, total=None)
            yield lambda text: progress.update(task, description=text)
    finally:
        if handle is not None:
            handle.remove()
