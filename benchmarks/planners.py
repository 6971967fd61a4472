"""Planner benchmark: ResNet-1000 budget table (optimal, ilp, the paper's planners), LSTM
T=1024, planning times (ResNet-1000, LSTM T=2048), and objective='time' on a real model.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/planners.py [--ilp-time-limit 10]

Captured graphs are cached as JSON under out/ (capture of LSTM T=2048 takes ~3 min); a cache
of an older graph schema is captured again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import memplan
from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.graph import SCHEMA_VERSION, Graph
from memplan.core.plan import Plan, make_plan
from memplan.core.planners import PLANNERS
from memplan.errors import BudgetTooSmall

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")
HEAD = ("\n| plan | predicted peak | extra FLOPs (% of step) | extra fwd passes | plan time | "
        "notes |\n|---|---|---|---|---|---|")


def graph(name: str, file: str, **params: Any) -> Graph:
    path = os.path.join(OUT, file)
    if os.path.exists(path):
        with open(path) as fh:
            data = json.load(fh)
        if data.get("schema_version") == SCHEMA_VERSION:
            return Graph.from_dict(data)
    t = time.perf_counter()
    g = memplan.capture(memplan.models.get(name, **params))
    print(f"(captured {file} in {time.perf_counter() - t:.0f} s)")
    os.makedirs(OUT, exist_ok=True)
    with open(path, "w") as fh:
        fh.write(g.to_json())
    return g


def row(label: str, plan: Plan, fwd: int, dt: float | None = None, note: str = "") -> str:
    t = f"{dt:6.2f} s" if dt is not None else ""
    return (f"| {label:32s} | {plan.peak_bytes / 1e9:7.3f} GB | {plan.extra_fraction:6.1%} | "
            f"{plan.extra_flops / fwd:5.2f} | {t} | {note} |")


def run(label: str, fn: Any, chain: Any, budget: int | None, fwd: int, plain: int = 0,
        **kw: Any) -> Plan | None:
    t = time.perf_counter()
    try:
        p: Plan = fn(chain, budget, **kw)
    except BudgetTooSmall as err:
        print(f"| {label:32s} | does not fit: least {err.least_peak_bytes / 1e9:.3f} GB | | | "
              f"{time.perf_counter() - t:6.2f} s | |")
        return None
    notes = "; ".join(n for n in p.notes if n.startswith(("MILP", "slot", "time")))
    if plain:
        notes = f"{plain / p.peak_bytes:.1f}x below plain" + (f"; {notes}" if notes else "")
    print(row(label, p, fwd, time.perf_counter() - t, notes))
    return p


def resnet(ilp_s: float) -> None:
    g = graph("resnet", "graph-resnet1000.json", depth=1000, batch=32)
    chain = C.build_chain(g)
    fwd = g.fwd_flops
    plain = S.simulate(chain, S.plain_schedule(chain))[0]
    print(f"\n## ResNet-1000 (batch 32, 224x224, fp32): {chain.n} stages, plain peak "
          f"{plain / 1e9:.2f} GB (trace {g.peak_bytes / 1e9:.2f} GB)")
    print(HEAD)
    for label, name, kw in [
        ("sqrt (19 segments, by bytes)", "sqrt", {}), ("sqrt, 18 segments", "sqrt",
                                                       {"segments": 18}),
        ("chen (Alg. 3 + grid)", "chen", {}), ("recursive k=1", "recursive", {"k": 1}),
        ("drop-cheap (all stages)", "drop-cheap", {}),
    ]:
        run(label, PLANNERS[name], chain, None, fwd, **kw)
    for gb in (4.0, 4.5, 5.0, 6.0, 7.0, 10.0):
        b = int(gb * 1e9)
        run(f"optimal @ {gb} GB", PLANNERS["optimal"], chain, b, fwd)
        run(f"optimal, no drop-cheap @ {gb} GB", PLANNERS["optimal"], chain, b, fwd,
            drop_cheap=False)
        if gb == 4.5:  # one point shows what merging stages into 100 groups costs
            run(f"optimal, 341 stages @ {gb} GB", PLANNERS["optimal"], chain, b, fwd,
                max_stages=400, slots=200)
        run(f"ilp @ {gb} GB", PLANNERS["ilp"], g, b, fwd, time_limit_s=ilp_s)
        if gb == 7.0:  # the MILP over all 341 stages: exact, but HiGHS finds less in the time
            run(f"ilp, 341 stages @ {gb} GB", PLANNERS["ilp"], g, b, fwd, time_limit_s=ilp_s,
                max_stages=400)
    run("optimal, least peak", PLANNERS["optimal"], chain, None, fwd)
    run("optimal no drop-cheap, least", PLANNERS["optimal"], chain, None, fwd, drop_cheap=False)
    run("ilp, least peak", PLANNERS["ilp"], g, None, fwd, time_limit_s=ilp_s)


def lstm(steps: int, ilp_s: float) -> None:
    g = graph("lstm", f"graph-lstm{steps}.json", steps=steps)
    chain = C.build_chain(g)
    plain = S.simulate(chain, S.plain_schedule(chain))[0]
    fwd = g.fwd_flops
    print(f"\n## LSTM T={steps} (batch 64, hidden 1024, 4 layers): {chain.n} stages, plain peak "
          f"{plain / 1e9:.3f} GB (trace {g.peak_bytes / 1e9:.3f} GB)")
    print(HEAD)
    for name in ("sqrt", "chen"):
        run(name, PLANNERS[name], chain, None, fwd, plain)
    for frac in (1 / 8, 1 / 16, 1 / 32):
        run(f"optimal @ plain/{1 / frac:.0f}", PLANNERS["optimal"], chain, int(plain * frac),
            fwd, plain)
    run("ilp @ plain/8", PLANNERS["ilp"], g, int(plain / 8), fwd, plain, time_limit_s=ilp_s)


def planning_times(repeat: int = 5) -> None:
    """From a captured Graph (capture excluded): build the chain, plan with optimal."""
    print(f"\n## Planning time, optimal planner from a captured Graph (min / median of {repeat})")
    print("\n| graph | fingerprint | build_chain (incl. fingerprint) | plan | total |")
    print("|---|---|---|---|---|")
    cases = [("ResNet-1000 @ 4.5 GB", "graph-resnet1000.json", "resnet", {"depth": 1000,
                                                                       "batch": 32}, 4.5e9),
             ("LSTM T=2048 @ plain/16", "graph-lstm2048.json", "lstm", {"steps": 2048}, None)]
    for label, file, name, params, budget in cases:
        g = graph(name, file, **params)
        fp, build, plan, total = [], [], [], []
        for _ in range(repeat):
            C._ARRAYS.clear()  # nothing cached: every run starts from the bare Graph
            t0 = time.perf_counter()
            _ = g.fingerprint  # Graph does not cache it: timed on its own too
            fp.append(time.perf_counter() - t0)
            C._ARRAYS.clear()
            t0 = time.perf_counter()
            chain = C.build_chain(g)
            t1 = time.perf_counter()
            b = int(budget) if budget else S.simulate(chain, S.plain_schedule(chain))[0] // 16
            t2 = time.perf_counter()
            PLANNERS["optimal"](chain, b)
            t3 = time.perf_counter()
            build.append(t1 - t0)
            plan.append(t3 - t2)
            total.append((t1 - t0) + (t3 - t2))
        print(f"| {label} | {cell(fp)} | {cell(build)} | {cell(plan)} | {cell(total)} |")


def cell(v: list[float]) -> str:
    return f"{min(v):.3f} / {statistics.median(v):.3f} s"


def time_objective(depth: int, batch: int, device: str) -> None:
    """objective='time' on a model that runs here: measured stage times vs FLOPs."""
    w = memplan.models.get("resnet", depth=depth, batch=batch)
    g = memplan.capture(w)
    chain = C.build_chain(g)
    t = time.perf_counter()
    from memplan.tracing.timing import stage_times

    times = stage_times(w, graph=g, device=device)
    dt = time.perf_counter() - t
    plain = S.simulate(chain, S.plain_schedule(chain))[0]
    budget = (PLANNERS["optimal"](chain, None).peak_bytes + plain) // 2
    print(f"\n## objective='time': ResNet-{depth}, batch {batch}, 224x224 on {device} "
          f"({chain.n} stages, forward {sum(times):.3f} s measured in {dt:.1f} s, median of 3)")
    print(f"budget {budget / 1e9:.3f} GB (halfway between the least peak and plain "
          f"{plain / 1e9:.3f} GB)")
    print("\n| objective | predicted peak | extra FLOPs | predicted step time |")
    print("|---|---|---|---|")
    for objective, kw in (("flops", {}), ("time", {"stage_time_s": times})):
        p = PLANNERS["optimal"](chain, budget, **kw)
        timed = make_plan(chain, p.schedule, "optimal", {}, budget, (), times)
        print(f"| {objective} | {p.peak_bytes / 1e9:.3f} GB | {p.extra_fraction:.1%} | "
              f"{timed.predicted_time_s:.3f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ilp-time-limit", type=float, default=10.0)
    ap.add_argument("--time-model-depth", type=int, default=50)
    ap.add_argument("--time-model-batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    resnet(args.ilp_time_limit)
    lstm(1024, args.ilp_time_limit)
    planning_times()
    time_objective(args.time_model_depth, args.time_model_batch, args.device)


if __name__ == "__main__":
    main()
