"""Planner benchmark (issue 14): the optimal and ilp planners on ResNet-1000 and the LSTM at
T=1024 over a budget table, and planning times (ResNet-1000 at 4.5 GB, LSTM T=2048 over
budgets from near its least peak to half its plain peak; each also at its least peak).

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planners.py \\
        [--graphs out] [--json out/planners.json] [--before out/planners-before.json]

Graphs are captured once and cached as JSON under --graphs (LSTM T=1024 takes ~2.5 min to
capture, T=2048 longer; delete a cached file after a change to capture or cut points).
``--json`` writes the measured rows; ``--before`` reads such a file (written by an older
memplan) and prints it beside this run. The reference column is the issue's exact figures
(an independent step-level DP on independently built models: its LSTM is the loop over
``nn.LSTMCell`` of ``user_loops.CellLSTM``, plain 9.15 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import memplan
from memplan.core import chain as C
from memplan.core import graph_arrays
from memplan.core import schedule as S
from memplan.core.evaluate import evaluate
from memplan.core.graph import SCHEMA_VERSION, Graph
from memplan.core.plan import Plan, make_plan
from memplan.core.planners import PLANNERS, optimal
from memplan.errors import BudgetTooSmall

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")
GB = 1e9
# (graph file, model, params, budgets in GB, reference extra % of step FLOPs from issue 14).
CASES: dict[str, tuple[str, str, dict[str, int], dict[float, float | None]]] = {
    "ResNet-1000": ("graph-resnet1000.json", "resnet", {"depth": 1000, "batch": 32},
                    {3.8: 33.54, 4.5: 29.94, 6.0: None, 7.0: 25.27, 10.0: None, 20.0: 4.83}),
    "LSTM T=1024": ("graph-lstm1024.json", "lstm", {"steps": 1024},
                    {0.5: 42.96, 0.6: 32.69, 0.7: 32.20, 1.0: 30.96, 3.0: 23.32}),
    # The issue's own LSTM build: a loop over nn.LSTMCell (plain 9.152 GB, the 9.15 GB;
    # memplan's LSTM Workload above is another build, 10.26 GB, with a module per step).
    "LSTM T=1024 (nn.LSTMCell)": ("graph-lstm1024-cells.json", "user:paper-lstmcell",
                                  {"steps": 1024},
                                  {0.5: 42.96, 0.6: 32.69, 0.7: 32.20, 1.0: 30.96, 3.0: 23.32}),
}
# Budgets in GB (None: a sixteenth of the plain peak); each is timed, and the least peak.
TIMED = {"ResNet-1000": ("graph-resnet1000.json", "resnet", {"depth": 1000, "batch": 32}, (4.5,)),
         "LSTM T=2048": ("graph-lstm2048.json", "lstm", {"steps": 2048},
                         (0.45, 0.6, None, 3.0, 10.0))}


def graph(graphs: str, file: str, name: str, params: dict[str, int]) -> Graph:
    path = os.path.join(graphs, file)
    if os.path.exists(path):
        with open(path) as fh:
            data = json.load(fh)
        if data.get("schema_version") == SCHEMA_VERSION:  # an older capture: capture again
            return Graph.from_dict(data)
    t = time.perf_counter()
    if name.startswith("user:"):  # a model built as users build it (``user_loops``)
        import user_loops

        model, inputs, loss_fn = user_loops.build(name.removeprefix("user:"), **params)
        g = memplan.capture(model, *inputs, loss_fn=loss_fn)
    else:
        g = memplan.capture(memplan.models.get(name, **params))
    print(f"(captured {file} in {time.perf_counter() - t:.0f} s)", flush=True)
    os.makedirs(graphs, exist_ok=True)
    with open(path, "w") as fh:
        fh.write(g.to_json())
    return g


def timed(fn: Callable[[], Plan]) -> tuple[Plan | None, float, float, str]:
    """(plan or None when the budget is too small, wall s, process s, note)."""
    w, p = time.perf_counter(), time.process_time()
    try:
        plan: Plan | None = fn()
        note = ""
    except BudgetTooSmall as err:
        plan, note = None, f"does not fit: least {err.least_peak_bytes / GB:.3f} GB"
    return plan, time.perf_counter() - w, time.process_time() - p, note


def budget_table(graphs: str, planners: list[str], ilp_s: float | None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, (file, name, params, budgets) in CASES.items():
        g = graph(graphs, file, name, params)
        chain = C.build_chain(g)
        plain = S.simulate(chain, S.plain_schedule(chain))[0]
        print(f"\n## {label}: {chain.n} stages, plain peak {plain / GB:.3f} GB, base "
              f"{chain.base_bytes / GB:.3f} GB", flush=True)
        for gb, ref in budgets.items():
            for planner in planners:
                kw: dict[str, Any] = ({"time_limit_s": ilp_s}
                                      if planner == "ilp" and ilp_s is not None else {})
                src = g if planner == "ilp" else chain
                plan, wall, cpu, note = timed(
                    lambda: PLANNERS[planner](src, int(gb * GB), **kw))  # noqa: B023
                row = {"model": label, "budget_gb": gb, "planner": planner, "ref": ref,
                       "peak": None if plan is None else plan.peak_bytes,
                       # The runtime's semantics (what memplan.plan holds a plan to).
                       "evaluated": None if plan is None else evaluate(g, plan).peak_bytes,
                       "extra": None if plan is None else 100 * plan.extra_fraction,
                       "wall_s": wall, "cpu_s": cpu,
                       "notes": note if plan is None else "; ".join(plan.notes)}
                rows.append(row)
                print(fmt_row(row), flush=True)
    return rows


def fmt_row(r: dict[str, Any], before: dict[str, Any] | None = None, side: bool = False) -> str:
    def cell(x: dict[str, Any] | None) -> list[str]:
        if x is None:
            return ["", "", ""]
        if x["peak"] is None:
            return [x["notes"], "", f"{x['wall_s']:.2f} s"]
        ev = x.get("evaluated")
        peak = f"{x['peak'] / GB:.3f} GB" + ("" if ev is None else f" ({ev / GB:.3f})")
        return [peak, f"{x['extra']:.2f}%", f"{x['wall_s']:.2f} s"]

    ref = "" if r["ref"] is None else f"{r['ref']:.2f}%"
    old = cell(before) if side else []
    cells = [r["model"], f"{r['budget_gb']:g} GB", r["planner"], ref, *old, *cell(r)]
    return "| " + " | ".join(cells) + " |"


def planning_times(graphs: str, repeat: int) -> list[dict[str, Any]]:
    """From a captured Graph (capture and JSON loading excluded): build_chain (no cache), then
    optimal at each budget of ``TIMED`` and without one (the least peak); min and median of
    ``repeat``."""
    rows: list[dict[str, Any]] = []
    for label, (file, name, params, budgets_gb) in TIMED.items():
        g = graph(graphs, file, name, params)
        chain = C.build_chain(g)
        plain = S.simulate(chain, S.plain_schedule(chain))[0]
        budgets = [int(b * GB) if b else plain // 16 for b in budgets_gb]
        cases = [(f"@ {b / GB:.3f} GB", b) for b in budgets] + [("least peak", None)]
        for what, budget in cases:
            build, wall, cpu = [], [], []
            for _ in range(repeat):
                graph_arrays._ARRAYS.clear()  # nothing cached: every run starts from the bare Graph
                optimal._least_peaks.clear()  # nor from a remembered least-peak schedule
                t0 = time.perf_counter()
                chain = C.build_chain(g)
                build.append(time.perf_counter() - t0)
                plan, w, p, _ = timed(lambda: PLANNERS["optimal"](chain, budget))  # noqa: B023
                wall.append(w)
                cpu.append(p)
            assert plan is not None
            row = {"model": label, "case": what, "stages": chain.n, "build": build,
                   "wall": wall, "cpu": cpu, "peak": plan.peak_bytes,
                   "extra": 100 * plan.extra_fraction}
            rows.append(row)
            print(fmt_time(row), flush=True)
    return rows


def fmt_time(r: dict[str, Any], before: dict[str, Any] | None = None, side: bool = False
             ) -> str:
    def mm(v: list[float]) -> str:
        return f"{min(v):.3f} / {statistics.median(v):.3f} s"

    old = [mm(before["wall"]), mm(before["cpu"])] if before else ["-", "-"] if side else []
    return (f"| {r['model']} ({r['stages']} stages) | {r['case']} | {mm(r['build'])} | "
            + " | ".join(old + [mm(r["wall"]), mm(r["cpu"])])
            + f" | {r['peak'] / GB:.3f} GB, {r['extra']:.2f}% |")


def time_objective(depth: int, batch: int, device: str) -> None:
    """objective='time' on a model that runs here: measured stage times vs FLOPs."""
    from memplan.tracing.timing import stage_times

    w = memplan.models.get("resnet", depth=depth, batch=batch)
    g = memplan.capture(w)
    chain = C.build_chain(g)
    times = stage_times(w, graph=g, device=device)
    plain = S.simulate(chain, S.plain_schedule(chain))[0]
    budget = (PLANNERS["optimal"](chain, None).peak_bytes + plain) // 2
    print(f"\n## objective='time': ResNet-{depth}, batch {batch}, 224x224 on {device}: budget "
          f"{budget / GB:.3f} GB (halfway between the least peak and plain {plain / GB:.3f} GB)")
    print("\n| objective | predicted peak | extra FLOPs | predicted step time |\n|---|---|---|---|")
    for objective, kw in (("flops", {}), ("time", {"stage_time_s": times})):
        p = PLANNERS["optimal"](chain, budget, **kw)
        timed_plan = make_plan(chain, p.schedule, "optimal", {}, budget, (), times)
        print(f"| {objective} | {p.peak_bytes / GB:.3f} GB | {p.extra_fraction:.1%} | "
              f"{timed_plan.predicted_time_s:.3f} s |")


def report(rows: list[dict[str, Any]], times: list[dict[str, Any]],
           before: dict[str, Any] | None) -> None:
    old = {(r["model"], r["budget_gb"], r["planner"]): r for r in (before or {}).get("rows", [])}
    old_t = {(r["model"], r["case"]): r for r in (before or {}).get("times", [])}
    side = "before: peak | extra | plan time | " if before else ""
    print(f"\n| model | budget | planner | reference | {side}peak (evaluated) | extra | plan time |")
    print("|---" * (7 + (3 if before else 0)) + "|")
    for r in rows:
        print(fmt_row(r, old.get((r["model"], r["budget_gb"], r["planner"])), before is not None))
    wall = "before: wall | before: CPU | " if before else ""
    print(f"\n| graph | case | build_chain | {wall}plan wall | plan CPU | plan |")
    print("|---" * (6 + (2 if before else 0)) + "|")
    for r in times:
        print(fmt_time(r, old_t.get((r["model"], r["case"])), before is not None))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--graphs", default=OUT, help="folder of cached captured graphs")
    ap.add_argument("--planners", default="optimal,ilp")
    ap.add_argument("--ilp-time-limit", type=float, default=None,
                    help="seconds of wall clock for ilp (default none: deterministic, "
                         "stopped by its node limit only)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sections", default="table,times", help="table, times, time-objective")
    ap.add_argument("--json", help="write the measured rows here")
    ap.add_argument("--before", help="a --json file of an earlier run, printed beside this one")
    ap.add_argument("--time-model-depth", type=int, default=50)
    ap.add_argument("--time-model-batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    sections = args.sections.split(",")
    print(f"load: {os.getloadavg()}", flush=True)
    # The kernels compile on first use (numba; cached on disk beside the source, so a fresh
    # checkout or worktree compiles again): not planning time, so paid here, before any timer.
    t = time.process_time()
    optimal.warm_up()
    print(f"numba warm-up: {time.process_time() - t:.2f} s CPU", flush=True)
    rows = budget_table(args.graphs, args.planners.split(","), args.ilp_time_limit) \
        if "table" in sections else []
    times = planning_times(args.graphs, args.repeat) if "times" in sections else []
    if "time-objective" in sections:
        time_objective(args.time_model_depth, args.time_model_batch, args.device)
    before = None
    if args.before:
        with open(args.before) as fh:
            before = json.load(fh)
    report(rows, times, before)
    print(f"load: {os.getloadavg()}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "times": times, "load": os.getloadavg()}, fh, indent=1)


if __name__ == "__main__":
    main()
