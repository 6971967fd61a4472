"""The live status while a step is captured (issue 12, item 8): shown on a terminal, with the
module calls counted so far; nothing on a pipe; the captured step is unchanged by it."""

from __future__ import annotations

import io

from rich.console import Console

import memplan
from memplan.cli.progress import working
from tests.small import small


def test_status_counts_module_calls_on_a_terminal_and_leaves_the_step_unchanged() -> None:
    w = small("resnet")
    plain = memplan.capture(w)
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    with working(console, "capturing resnet") as say:
        watched = memplan.capture(w)
        say("planning")
    assert watched.fingerprint == plain.fingerprint and watched.to_json() == plain.to_json()
    shown = screen.getvalue()
    assert "module calls" in shown and "planning" in shown
    calls = int(shown.split("module calls: ")[-1].split()[0].replace(",", ""))
    assert calls >= len({c.path for c in plain.module_calls})


def test_no_status_on_a_pipe() -> None:
    pipe = io.StringIO()
    with working(Console(file=pipe, force_terminal=False), "capturing"):
        memplan.capture(small("lstm"))
    assert pipe.getvalue() == ""


def test_status_text_prints_as_it_is() -> None:
    """A path or factory in the status ('runs/[/red]', 'pkg:llama: ...') is text, not rich
    markup: '[/red]' ended in a MarkupError, ':llama:' printed an emoji."""
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    with working(console, "verifying runs/[/red]/p.json on pkg:llama: a step",
                 count_calls=False) as say:
        say("bench pkg:llama: [bold]plain")
    shown = screen.getvalue()
    assert "runs/[/red]/p.json on pkg:llama: a step" in shown
    assert "bench pkg:llama: [bold]plain" in shown and "\N{LLAMA}" not in shown
