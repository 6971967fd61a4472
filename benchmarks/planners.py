"""Planner benchmark: ResNet-1000 budget table, LSTM T=1024 figure, planning times.

    .venv/bin/python benchmarks/planners.py

Captured graphs are cached as JSON under out/ (capture of LSTM T=2048 takes ~2 min).
"""

from __future__ import annotations

import json
import os
import time

import memplan
from memplan import chain as C
from memplan.budget import BudgetTooSmall
from memplan.graph import Graph
from memplan.planners import PLANNERS

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out")


def graph(name: str, file: str, **params: object) -> Graph:
    path = os.path.join(OUT, file)
    if os.path.exists(path):
        with open(path) as fh:
            return Graph.from_dict(json.load(fh))
    g = memplan.capture(memplan.models.get(name, **params))
    os.makedirs(OUT, exist_ok=True)
    with open(path, "w") as fh:
        fh.write(g.to_json())
    return g


def row(label: str, plan: memplan.plan.Plan, fwd: int, dt: float | None = None) -> str:
    t = f"{dt:6.2f} s" if dt is not None else ""
    return (f"| {label:28s} | {plan.peak_bytes / 1e9:7.3f} GB | {plan.extra_fraction:6.1%} | "
            f"{plan.extra_flops / fwd:5.2f} | {t} |")


def resnet() -> None:
    g = graph("resnet", "graph-resnet1000.json", depth=1000, batch=32)
    t0 = time.perf_counter()
    chain = C.build_chain(g)
    t_chain = time.perf_counter() - t0
    fwd = g.fwd_flops
    plain = C.simulate(chain, C.plain_schedule(chain))[0]
    print(f"\n## ResNet-1000 (batch 32, 224x224, fp32): {chain.n} stages, plain peak "
          f"{plain / 1e9:.2f} GB (trace {g.meta['peak_bytes'] / 1e9:.2f} GB), "
          f"chain built in {t_chain:.2f} s")
    print("\n| plan | predicted peak | extra FLOPs (% of step) | extra fwd passes | plan time |")
    print("|---|---|---|---|---|")
    for label, fn, kw in [
        ("sqrt (19 segments, by bytes)", PLANNERS["sqrt"], {}),
        ("sqrt, 18 segments", PLANNERS["sqrt"], {"segments": 18}),
        ("chen (Alg. 3 + grid)", PLANNERS["chen"], {}),
        ("recursive k=1", PLANNERS["recursive"], {"k": 1}),
        ("drop-cheap (all stages)", PLANNERS["drop-cheap"], {}),
    ]:
        t = time.perf_counter()
        p = fn(chain, None, **kw)
        print(row(label, p, fwd, time.perf_counter() - t))
    for gb in (4.0, 4.5, 5.0, 6.0, 7.0, 10.0):
        for label, kw in [("optimal", {}), ("optimal, no drop-cheap", {"drop_cheap": False}),
                          ("optimal, 341 stages", {"max_stages": 400, "slots": 200})]:
            if "341" in label and gb != 4.5:
                continue  # ~25 s each: one point shows what merging stages costs
            t = time.perf_counter()
            try:
                p = PLANNERS["optimal"](chain, int(gb * 1e9), **kw)
            except BudgetTooSmall as err:
                print(f"| {label} @ {gb} GB | does not fit: least {err.least_peak_bytes / 1e9:.3f}"
                      " GB | | | |")
                continue
            print(row(f"{label} @ {gb} GB", p, fwd, time.perf_counter() - t))
    t = time.perf_counter()
    least = PLANNERS["optimal"](chain, None)
    print(row("optimal, least peak", least, fwd, time.perf_counter() - t))
    least_nd = PLANNERS["optimal"](chain, None, drop_cheap=False)
    print(row("optimal no drop-cheap, least", least_nd, fwd))


def lstm(steps: int, budget_fraction: float | None) -> None:
    g = graph("lstm", f"graph-lstm{steps}.json", steps=steps)
    t0 = time.perf_counter()
    chain = C.build_chain(g)
    t_chain = time.perf_counter() - t0
    plain = C.simulate(chain, C.plain_schedule(chain))[0]
    fwd = g.fwd_flops
    print(f"\n## LSTM T={steps} (batch 64, hidden 1024, 4 layers): {chain.n} stages, plain peak "
          f"{plain / 1e9:.3f} GB (trace {g.meta['peak_bytes'] / 1e9:.3f} GB), chain built in "
          f"{t_chain:.2f} s")
    print("\n| plan | predicted peak | extra FLOPs (% of step) | extra fwd passes | plan time |")
    print("|---|---|---|---|---|")
    for name in ("sqrt", "chen"):
        t = time.perf_counter()
        p = PLANNERS[name](chain, None)
        print(row(name, p, fwd, time.perf_counter() - t) + f" {plain / p.peak_bytes:.1f}x")
    fractions = [budget_fraction] if budget_fraction else [1 / 8, 1 / 16, 1 / 32]
    for frac in fractions:
        t = time.perf_counter()
        try:
            p = PLANNERS["optimal"](chain, int(plain * frac))
        except BudgetTooSmall as err:
            print(f"| optimal @ plain/{1 / frac:.0f} | does not fit: least "
                  f"{err.least_peak_bytes / 1e9:.3f} GB | | | |")
            continue
        dt = time.perf_counter() - t
        print(row(f"optimal @ plain/{1 / frac:.0f}", p, fwd, dt) + f" {plain / p.peak_bytes:.1f}x")


if __name__ == "__main__":
    resnet()
    lstm(1024, None)
    lstm(2048, 1 / 16)
