"""``memplan plan MODEL --budget B -o plan.json``: capture, plan, show the plan per stage."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.table import Table

from memplan.cli.common import (
    MAX_BATCH,
    MODEL_HELP,
    check_writable,
    int_in,
    wide_console,
    write_result,
)
from memplan.cli.progress import working
from memplan.core.budget import budget_from_text, format_bytes, parse_budget
from memplan.core.plan import Plan, Stage
from memplan.core.plan_schema import printable
from memplan.core.planners import NAMES as PLANNER_NAMES
from memplan.errors import BudgetTooSmall, bad_arg


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="plan what to keep and what to recompute under a budget")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--batch", type=int_in(1, MAX_BATCH, "--batch 32"),
                   help="override a built-in model's batch size")
    p.add_argument("--budget", help="peak budget: 6GiB, 7GB, bytes, or a fraction of the "
                   "plain peak like 0.25 (default: none; optimal then finds the least peak)")
    p.add_argument("--planner", default="optimal", choices=sorted(PLANNER_NAMES),
                   help=f"one of {', '.join(sorted(PLANNER_NAMES))} (default optimal)")
    p.add_argument("--objective", default="flops", choices=("flops", "time"),
                   help="what the planner minimises: recomputed FLOPs (default) or predicted "
                   "step time (times each stage's forward for real on --device)")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda: where --objective time measures stage times")
    p.add_argument("-o", "--output", metavar="PLAN_JSON", help="write the plan file here")
    p.add_argument("--all-stages", action="store_true",
                   help="one table row per stage (default: runs of the same mode grouped)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memplan.api import TIME_PLANNERS
    from memplan.api import plan as make_plan
    from memplan.cli.spec import estimate, resolve
    from memplan.tracing.device import check_device

    # Everything the user typed is checked before the work, each error naming its flag.
    budget = budget_from_text(args.budget)
    if budget is not None:
        parse_budget(budget, plain_peak_bytes=1, arg="--budget")
    if args.objective == "time" and args.planner not in TIME_PLANNERS:
        raise bad_arg("--planner", f"one of {list(TIME_PLANNERS)} with --objective time",
                      args.planner, "Use --planner optimal, or --objective flops.")
    if args.output is not None:
        check_writable(args.output, "-o")
    check_device(args.device, "--device")
    console = wide_console()
    target = resolve(args.model, args.batch)
    obj, inputs, kwargs, loss_fn = target.call_args()
    start = time.perf_counter()
    with working(console, f"capturing and planning {estimate(target)}"):
        try:
            plan = make_plan(obj, *inputs, kwargs=kwargs, loss_fn=loss_fn, budget=budget,
                             planner=args.planner, objective=args.objective,
                             device=args.device)
        except BudgetTooSmall as err:
            raise flag_worded(err) from err
    seconds = time.perf_counter() - start
    console.print(stage_table(plan, target.label, args.all_stages))
    console.print(summary_lines(plan))
    console.print(f"  captured and planned in {seconds:.1f} s")
    if args.output is not None:
        write_result(args.output, plan.to_json(), "-o", "plan")
        console.print(f"  plan written to {args.output} (read it with: memplan explain "
                      f"{args.output})")
    return 0


def flag_worded(err: BudgetTooSmall) -> BudgetTooSmall:
    """The refusal with its fixes written as flags (the library's says planner='...')."""
    other = (", or try --planner optimal (it reaches the lowest peaks)"
             if err.planner != "optimal" else "")
    return BudgetTooSmall(
        err.budget_bytes, err.least_peak_bytes, err.planner,
        f"--budget {format_bytes(err.budget_bytes)} ({err.budget_bytes:,} B) is below the least "
        f"feasible peak {format_bytes(err.least_peak_bytes)} ({err.least_peak_bytes:,} B) of "
        f"planner '{err.planner}'. Raise the budget: --budget {err.least_peak_bytes} or "
        f"more{other}.")


MAX_GROUPS = 40  # rows shown before the middle of a long table is elided

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
    title = (f"{printable(label)}: plan {plan.planner!r}, {len(plan.stages)} stages"
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
            printable(a.module if a is b else f"{a.module} .. {b.module}"),
            _mode_label(a.mode),
            str(a.mirror),
            format_bytes(sum(s.saved_bytes for s in grp)),
            f"{fwd:.3g}",
            f"{recomputed:.3g}" if a.mode == "recompute" else cheap,
        )
    return table


def _mode_label(mode: str) -> str:
    return {"keep": "kept", "recompute": "recomputed", "drop-cheap": "drop-cheap"}.get(mode, mode)


def summary_lines(plan: Plan) -> str:
    fwd = sum(s.fwd_flops for s in plan.stages)
    lines = [
        f"  predicted peak {format_bytes(plan.peak_bytes)} vs plain {format_bytes(plan.plain_peak_bytes)}"
        f" ({plan.plain_peak_bytes / max(plan.peak_bytes, 1):.1f}x less)"
        + (f", budget {format_bytes(plan.budget_bytes)}" if plan.budget_bytes else ""),
        (f"  extra compute {plan.extra_flops:.3g} FLOPs = {plan.extra_fraction:.1%} of the plain "
        f"step ({plan.extra_flops / max(fwd, 1):.2f} extra forward passes)"),
    ]
    if plan.predicted_time_s is not None:
        lines.append(f"  predicted step time {plan.predicted_time_s:.3f} s")
    return "\n".join(lines)
