"""``memplan plan`` and ``memplan explain``: make a plan, show it per stage, save and read it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from memplan.budget import fmt_bytes
from memplan.errors import MemplanError, bad_arg
from memplan.plan import Plan, Stage

MAX_GROUPS = 40  # rows shown before the middle of a long table is elided

_INT = re.compile(r"^\s*[0-9]+\s*$")
_FLOAT = re.compile(r"^\s*[0-9]*\.[0-9]+\s*$|^\s*[0-9]+\.[0-9]*\s*$")


def budget_arg(text: str | None) -> object:
    """CLI budget text -> what ``memplan.plan`` accepts: '6GiB' (str), '0.25' (fraction of the
    plain peak), '5000000000' (bytes)."""
    if text is None:
        return None
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


def make_plan(spec: str, batch: int | None, budget: str | None, planner: str, objective: str,
              device: str = "cpu") -> tuple[Plan, float, str]:
    """Capture the model named by ``spec`` and plan it (``objective='time'`` also times each
    stage's forward for real on ``device``); returns the plan, the seconds and the label."""
    import memplan
    from memplan.bench import check_device
    from memplan.spec import resolve

    check_device(device, real=True)
    target = resolve(spec, batch)
    obj, inputs, loss_fn = target.call_args()
    start = time.perf_counter()
    plan = memplan.plan(obj, *inputs, loss_fn=loss_fn, budget=budget_arg(budget),
                        planner=planner, objective=objective, device=device)
    return plan, time.perf_counter() - start, target.label


def wide_console() -> Console:
    """A console; 120 columns when writing to a pipe or log (rich's default there is 80)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def run_plan(spec: str, batch: int | None, budget: str | None, planner: str, objective: str,
             out: str | None, all_stages: bool, device: str = "cpu",
             console: Console | None = None) -> int:
    console = console or wide_console()
    if out is not None:
        _check_writable(out)
    with console.status(f"capturing and planning {spec} ..."):
        plan, seconds, label = make_plan(spec, batch, budget, planner, objective, device)
    console.print(stage_table(plan, label, all_stages))
    console.print(summary_lines(plan))
    console.print(f"  captured and planned in {seconds:.1f} s")
    if out is not None:
        Path(out).write_text(plan.to_json())
        console.print(f"  plan written to {out} (read it with: memplan explain {out})")
    return 0


def _check_writable(out: str) -> None:
    parent = Path(out).resolve().parent
    if not parent.is_dir():
        raise bad_arg("-o", "a file in an existing directory", out,
                      f"Create {parent} first or write the plan elsewhere.")
    if Path(out).is_dir():
        raise bad_arg("-o", "a file path, not a directory", out, "Name a file, e.g. plan.json.")


def groups(stages: tuple[Stage, ...], all_stages: bool) -> list[list[Stage]]:
    """Consecutive stages with the same mode and mirror depth, or one stage per group."""
    out: list[list[Stage]] = []
    for s in stages:
        if out and not all_stages and (out[-1][-1].mode, out[-1][-1].mirror) == (s.mode, s.mirror):
            out[-1].append(s)
        else:
            out.append([s])
    return out


def stage_table(plan: Plan, label: str, all_stages: bool = False) -> Table:
    gs = groups(plan.stages, all_stages)
    title = (f"{label}: plan '{plan.planner}', {len(plan.stages)} stages"
             + ("" if all_stages else f" in {len(gs)} runs of the same mode (--all-stages: each)"))
    table = Table(title=title)
    for col, justify in (("stages", "right"), ("modules", "left"), ("mode", "left"),
                         ("mirror", "right"), ("plain saves", "right"),
                         ("forward FLOPs", "right"), ("recomputed FLOPs", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    shown = gs
    if not all_stages and len(gs) > MAX_GROUPS:
        shown = gs[: MAX_GROUPS // 2] + gs[-MAX_GROUPS // 2:]
    for i, grp in enumerate(shown):
        if shown is not gs and i == MAX_GROUPS // 2:
            hidden = gs[MAX_GROUPS // 2: -MAX_GROUPS // 2]
            n = sum(len(g) for g in hidden)
            table.add_row("...", f"{len(hidden)} more runs ({n} stages): --all-stages lists them",
                          "", "", "", "", "")
        a, b = grp[0], grp[-1]
        fwd = sum(s.fwd_flops for s in grp)
        recomputed = sum(s.fwd_flops * s.mirror for s in grp if s.mode == "recompute")
        cheap = "some (cheap ops)" if a.mode == "drop-cheap" else "0"
        table.add_row(
            str(a.index) if a is b else f"{a.index}..{b.index}",
            a.module if a is b else f"{a.module} .. {b.module}",
            _mode_label(a.mode),
            str(a.mirror),
            fmt_bytes(sum(s.saved_bytes for s in grp)),
            f"{fwd:.3g}",
            f"{recomputed:.3g}" if a.mode == "recompute" else cheap,
        )
    return table


def _mode_label(mode: str) -> str:
    return {"keep": "kept", "recompute": "recomputed", "drop-cheap": "drop-cheap"}.get(mode, mode)


def summary_lines(plan: Plan) -> str:
    fwd = sum(s.fwd_flops for s in plan.stages)
    lines = [
        f"  predicted peak {fmt_bytes(plan.peak_bytes)} vs plain {fmt_bytes(plan.plain_peak_bytes)}"
        f" ({plan.plain_peak_bytes / max(plan.peak_bytes, 1):.1f}x less)"
        + (f", budget {fmt_bytes(plan.budget_bytes)}" if plan.budget_bytes else ""),
        (f"  extra compute {plan.extra_flops:.3g} FLOPs = {plan.extra_fraction:.1%} of the plain "
        f"step ({plan.extra_flops / max(fwd, 1):.2f} extra forward passes)"),
    ]
    if plan.predicted_time_s is not None:
        lines.append(f"  predicted step time {plan.predicted_time_s:.3f} s")
    return "\n".join(lines)


def load_plan(path: str) -> Plan:
    """A plan file, with one-line errors for missing, unreadable or invalid files."""
    p = Path(path)
    fix = "Make one with: memplan plan MODEL -o plan.json"
    if not p.exists():
        raise bad_arg("PLAN", "an existing plan file", path, f"No such file. {fix}")
    if p.is_dir():
        raise bad_arg("PLAN", "a plan file, not a directory", path, fix)
    try:
        data: Any = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise MemplanError(f"PLAN: cannot read {path}: {err}. {fix}") from err
    except json.JSONDecodeError as err:
        raise MemplanError(f"PLAN: {path} is not JSON ({err}). {fix}") from err
    if not isinstance(data, dict):
        raise bad_arg("PLAN", "a JSON object written by memplan plan -o", type(data).__name__, fix)
    try:
        return Plan.from_dict(data)
    except MemplanError as err:
        raise MemplanError(f"PLAN {path}: {err}") from err
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise MemplanError(
            f"PLAN: {path} is not a valid memplan plan ({type(err).__name__}: {err}). {fix}"
        ) from err


def run_explain(path: str) -> int:
    plan = load_plan(path)
    print(plan.explain())
    return 0
