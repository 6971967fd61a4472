"""``memplan reproduce``: the paper's Fig. 5 (ResNet memory vs depth), Fig. 6 (LSTM memory vs
unroll) and Fig. 7 (time per batch), ours computed in the run, the paper's numbers beside them.

Fig. 5/6 are simulated at paper scale on fake tensors: the static allocator's feature-map bytes
(Fig. 5a/6a: none, sharing, sublinear = sqrt segments) and total peaks (Fig. 5b/6b: plain
PyTorch measured by the tracker, memplan's sqrt and optimal plans predicted, and measured after
``memplan.apply`` when the runtime provides it). Fig. 7 runs real steps on this CPU at small
scale: plain vs memplan's plans vs torch's checkpoint_sequential.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memplan.errors import bad_arg

Row = dict[str, Any]
Sweep = tuple[str, str, dict[str, Any], list[int]]
FIG5: Sweep = ("resnet", "depth", {"batch": 32}, [128, 256, 512, 1000, 1024])
FIG6: Sweep = ("lstm", "steps", {}, [64, 128, 256, 512, 1024, 2048])
FIG7: list[Sweep] = [("resnet", "depth", {"batch": 4, "image": 64, "classes": 100}, [26, 50, 101]),
        ("lstm", "steps", {"batch": 16, "hidden": 256, "classes": 500}, [32, 64, 128])]
QUICK5: Sweep = ("resnet", "depth", {"batch": 2, "image": 32, "classes": 10}, [14, 26])
QUICK6: Sweep = ("lstm", "steps", {"batch": 2, "hidden": 32, "input": 8, "classes": 10}, [4, 8])
QUICK7: list[Sweep] = [("resnet", "depth", {"batch": 2, "image": 32, "classes": 10}, [14]),
          ("lstm", "steps", {"batch": 2, "hidden": 32, "input": 8, "classes": 10}, [4, 8])]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("reproduce", help="the paper's Fig. 5, 6 and 7, ours beside the paper's",
                       description=__doc__)
    p.add_argument("--figs", default="5,6,7", help="which figures (default 5,6,7)")
    p.add_argument("--quick", action="store_true", help="tiny models: seconds, not paper scale")
    p.add_argument("--least", action="store_true",
                   help="also the optimal planner's least-peak plan per size (~7 s each)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes for Fig. 5/6 (2)")
    p.add_argument("--repeat", type=int, default=7,
                   help="timed rounds per Fig. 7 row (median; the paper ran 20 batches)")
    p.add_argument("--out", default="out/reproduce", help="output folder (out/reproduce)")
    p.set_defaults(run=run)


def parse_figs(text: str) -> list[int]:
    try:
        figs = sorted({int(f) for f in text.split(",") if f.strip()})
    except ValueError:
        figs = []
    if not figs or not set(figs) <= {5, 6, 7}:
        raise bad_arg("--figs", "a comma-separated subset of 5,6,7", text, "Use e.g. --figs 5,6.")
    return figs


def run(args: argparse.Namespace) -> int:
    from memplan import reproduce_report as R

    figs = parse_figs(args.figs)
    if args.jobs < 1 or args.repeat < 1:
        raise bad_arg("--jobs/--repeat", "integers >= 1", (args.jobs, args.repeat),
                      "Use e.g. --jobs 2 --repeat 3.")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise bad_arg("--out", "a folder", str(out), "Name a folder (it is created if missing).")
    from memplan.commands import wide_console

    console = wide_console()
    start = time.perf_counter()
    sweeps = [s for f, s in ((5, QUICK5 if args.quick else FIG5),
                             (6, QUICK6 if args.quick else FIG6)) if f in figs]
    memory = memory_rows(sweeps, args.jobs, args.least, console)
    timing = time_rows(QUICK7 if args.quick else FIG7, args.repeat, console) if 7 in figs else []
    paths = R.write(memory, timing, out, quick=args.quick)
    print(R.markdown(memory, timing, quick=args.quick))
    console.print(f"reproduce finished in {time.perf_counter() - start:.1f} s; wrote "
                  + ", ".join(str(p) for p in paths))
    return 0


def memory_rows(sweeps: list[Sweep], jobs: int,
                least: bool, console: Console) -> list[Row]:
    """One row per (model, size), computed in ``jobs`` spawn workers, longest first."""
    tasks = [(name, key, {**base, key: size}, least) for name, key, base, sizes in sweeps
             for size in sizes]
    if not tasks:
        return []
    order = sorted(range(len(tasks)), key=lambda i: -_cost(tasks[i]))
    results: dict[int, Row] = {}
    with _bar(console) as bar:
        task = bar.add_task("Fig. 5/6 (simulated, paper scale)", total=len(tasks))
        if jobs == 1:
            for i in order:
                results[i] = memory_row(*tasks[i])
                bar.update(task, advance=1)
        else:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                futures = {i: pool.submit(memory_row, *tasks[i]) for i in order}
                for i in order:
                    results[i] = futures[i].result()
                    bar.update(task, advance=1, description=f"Fig. 5/6: {tasks[i][0]} "
                               f"{tasks[i][1]}={tasks[i][2][tasks[i][1]]}")
    return [results[i] for i in range(len(tasks))]


def _cost(task: tuple[str, str, dict[str, Any], bool]) -> int:
    name, key, params, _ = task
    return int(params[key]) * (10 if name == "lstm" else 5)


def _bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console)


def memory_row(name: str, key: str, params: dict[str, Any], least: bool) -> Row:
    """Everything Fig. 5/6 need for one size: static feature maps and total peaks."""
    import memplan
    from memplan.allocation import allocate
    from memplan.bench import applied_workload, apply_fn
    from memplan.mirror_plans import sqrt_plan
    from memplan.training_graph import training_graph

    w = memplan.models.get(name, **params)
    t0 = time.perf_counter()
    graph = memplan.capture(w)
    row: Row = {"model": name, "size_key": key, "size": params[key], "spec": w.spec,
                "capture_s": round(time.perf_counter() - t0, 1),
                "plain_peak_bytes": int(graph.meta["peak_bytes"])}
    plain_tg = training_graph(graph)
    row["static_none_bytes"] = allocate(plain_tg, "none").total_bytes
    row["static_sharing_bytes"] = allocate(plain_tg, "sharing").total_bytes
    row["static_sublinear_bytes"] = allocate(training_graph(graph, sqrt_plan(graph)),
                                             "sharing").total_bytes
    t0 = time.perf_counter()
    sqrt = memplan.plan(graph, planner="sqrt")
    best = memplan.plan(graph, planner="optimal", budget=sqrt.peak_bytes)
    plans = {"sqrt": sqrt, "optimal": best}
    if least:
        plans["least"] = memplan.plan(graph, planner="optimal")
    row["plan_s"] = round(time.perf_counter() - t0, 1)
    for label, p in plans.items():
        row[f"{label}_peak_bytes"] = p.peak_bytes
        row[f"{label}_extra_pct"] = round(100 * p.extra_fraction, 2)
    apply = apply_fn()
    if apply is not None:
        for label in ("sqrt", "optimal"):
            try:
                rep = memplan.measure(applied_workload(w, plans[label], apply), simulate=True)
                row[f"{label}_measured_bytes"] = rep.peak_bytes
            except memplan.MemplanError as err:
                row["note"] = f"apply failed: {err}"
    return row


def time_rows(sweeps: list[Sweep], repeat: int, console: Console) -> list[Row]:
    """Fig. 7: real step times on this CPU (one thread), plain vs torch's checkpoint_sequential
    vs memplan's plans (applied), timed interleaved (round-robin over the variants, medians) so
    that load from other processes hits all alike; and each variant's measured peak."""
    import torch

    import memplan
    from memplan.peers import peer_workload

    rows: list[Row] = []
    total = sum(len(s[3]) for s in sweeps)
    apply = getattr(memplan, "apply", None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _bar(console) as bar:
            task = bar.add_task("Fig. 7 (real CPU steps)", total=total)
            for name, key, base, sizes in sweeps:
                for size in sizes:
                    w = memplan.models.get(name, **{**base, key: size})
                    rows.append(_time_row(w, key, size, repeat, apply, peer_workload))
                    bar.update(task, advance=1, description=f"Fig. 7: {name} {key}={size}")
    finally:
        torch.set_num_threads(threads)
    return rows


def _time_row(w: Any, key: str, size: int, repeat: int, apply: Any, peer_workload: Any) -> Row:
    import memplan

    graph = memplan.capture(w)
    sqrt = memplan.plan(graph, planner="sqrt")
    best = memplan.plan(graph, planner="optimal", budget=sqrt.peak_bytes)
    row: Row = {"model": w.name, "size_key": key, "size": size, "spec": w.spec,
                "sqrt_extra_pct": round(100 * sqrt.extra_fraction, 2),
                "optimal_extra_pct": round(100 * best.extra_fraction, 2), "threads": 1,
                "repeat": repeat}
    inputs = w.build_inputs()
    variants: dict[str, Any] = {
        "plain": w.build_model(),
        "checkpoint_sequential": peer_workload(w, "checkpoint_sequential").build_model()}
    if apply is not None:
        for label, plan in (("sqrt", sqrt), ("optimal", best)):
            try:
                variants[label] = apply(w.build_model(), plan)
            except memplan.MemplanError as err:
                row["note"] = f"apply failed: {' '.join(str(err).split())}"
    for label, model in variants.items():
        rep = memplan.measure(model, *inputs, loss_fn=w.loss, simulate=False, repeat=1)
        row[f"{label}_peak_bytes"] = rep.peak_bytes
    from memplan.bench import interleaved_step_times

    times = interleaved_step_times([(m, inputs) for m in variants.values()], w.loss, repeat)
    for label, t in zip(variants, times):
        row[f"{label}_time_s"] = t
    return row
