"""``memplan reproduce``: the paper's Fig. 5 (ResNet memory vs depth), Fig. 6 (LSTM memory vs
unroll) and Fig. 7 (time per batch), ours computed in the run, the paper's numbers beside them.

Fig. 5/6 are simulated at paper scale on fake tensors: the static allocator's feature-map bytes
(Fig. 5a/6a: none, sharing, sublinear = sqrt segments) and total peaks (Fig. 5b/6b: plain
PyTorch measured by the tracker, memplan's sqrt and optimal plans predicted, and measured after
``memplan.apply`` when the runtime provides it). Fig. 7 runs real steps on this CPU at small
scale: plain vs memplan's plans vs torch's checkpoint_sequential.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from memplan import models
from memplan.analysis.bench import applied_workload
from memplan.analysis.peers import peer_workload
from memplan.api import plan as make_plan
from memplan.core.static.allocation import allocate
from memplan.core.static.mirror_plans import sqrt_mirror
from memplan.core.static.training_graph import training_graph
from memplan.errors import MemplanError
from memplan.runtime.apply import apply
from memplan.tracing.capture import capture
from memplan.tracing.measure import measure
from memplan.tracing.timing import step_times

Progress = Callable[[str], None]
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


def memory_rows(sweeps: list[Sweep], jobs: int, least: bool, progress: Progress) -> list[Row]:
    """One row per (model, size), computed in ``jobs`` spawn workers, longest first;
    ``progress(label)`` after each."""
    tasks = [(name, key, {**base, key: size}, least) for name, key, base, sizes in sweeps
             for size in sizes]
    order = sorted(range(len(tasks)), key=lambda i: -_cost(tasks[i]))
    results: dict[int, Row] = {}
    if jobs == 1:
        for i in order:
            results[i] = memory_row(*tasks[i])
            progress(_label(tasks[i]))
    elif tasks:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {i: pool.submit(memory_row, *tasks[i]) for i in order}
            for i in order:
                results[i] = futures[i].result()
                progress(_label(tasks[i]))
    return [results[i] for i in range(len(tasks))]


def _label(task: tuple[str, str, dict[str, Any], bool]) -> str:
    name, key, params, _ = task
    return f"Fig. 5/6: {name} {key}={params[key]}"


def _cost(task: tuple[str, str, dict[str, Any], bool]) -> int:
    name, key, params, _ = task
    return int(params[key]) * (10 if name == "lstm" else 5)


def memory_row(name: str, key: str, params: dict[str, Any], least: bool) -> Row:
    """Everything Fig. 5/6 need for one size: static feature maps and total peaks."""
    w = models.get(name, **params)
    t0 = time.perf_counter()
    graph = capture(w)
    row: Row = {"model": name, "size_key": key, "size": params[key], "spec": w.spec,
                "capture_s": round(time.perf_counter() - t0, 1),
                "plain_peak_bytes": int(graph.peak_bytes)}
    plain_tg = training_graph(graph)
    row["static_none_bytes"] = allocate(plain_tg, "none").total_bytes
    row["static_sharing_bytes"] = allocate(plain_tg, "sharing").total_bytes
    row["static_sublinear_bytes"] = allocate(training_graph(graph, sqrt_mirror(graph)),
                                             "sharing").total_bytes
    t0 = time.perf_counter()
    sqrt = make_plan(graph, planner="sqrt")
    best = make_plan(graph, planner="optimal", budget=sqrt.peak_bytes)
    plans = {"sqrt": sqrt, "optimal": best}
    if least:
        plans["least"] = make_plan(graph, planner="optimal")
    row["plan_s"] = round(time.perf_counter() - t0, 1)
    for label, p in plans.items():
        row[f"{label}_peak_bytes"] = p.peak_bytes
        row[f"{label}_extra_pct"] = round(100 * p.extra_fraction, 2)
    for label in ("sqrt", "optimal"):
        try:
            rep = measure(applied_workload(w, plans[label]), simulate=True)
            row[f"{label}_measured_bytes"] = rep.peak_bytes
        except MemplanError as err:
            row["note"] = f"apply failed: {err}"
    return row


def time_rows(sweeps: list[Sweep], repeat: int, progress: Progress) -> list[Row]:
    """Fig. 7: real step times on this CPU (one thread), plain vs torch's checkpoint_sequential
    vs memplan's plans (applied), timed interleaved (round-robin over the variants, medians) so
    that load from other processes hits all alike; and each variant's measured peak."""
    rows: list[Row] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, key, base, sizes in sweeps:
            for size in sizes:
                w = models.get(name, **{**base, key: size})
                rows.append(_time_row(w, key, size, repeat))
                progress(f"Fig. 7: {name} {key}={size}")
    finally:
        torch.set_num_threads(threads)
    return rows


def _time_row(w: Any, key: str, size: int, repeat: int) -> Row:
    graph = capture(w)
    sqrt = make_plan(graph, planner="sqrt")
    best = make_plan(graph, planner="optimal", budget=sqrt.peak_bytes)
    row: Row = {"model": w.name, "size_key": key, "size": size, "spec": w.spec,
                "sqrt_extra_pct": round(100 * sqrt.extra_fraction, 2),
                "optimal_extra_pct": round(100 * best.extra_fraction, 2), "threads": 1,
                "repeat": repeat}
    inputs = w.build_inputs()
    variants: dict[str, Any] = {
        "plain": w.build_model(),
        "checkpoint_sequential": peer_workload(w, "checkpoint_sequential").build_model()}
    for label, plan in (("sqrt", sqrt), ("optimal", best)):
        try:
            variants[label] = apply(w.build_model(), plan)
        except MemplanError as err:
            row["note"] = f"apply failed: {' '.join(str(err).split())}"
    for label, model in variants.items():
        rep = measure(model, *inputs, loss_fn=w.loss, simulate=False, repeat=1)
        row[f"{label}_peak_bytes"] = rep.peak_bytes
    times = step_times([(m, inputs) for m in variants.values()], w.loss, repeat)
    for label, t in zip(variants, times):
        row[f"{label}_time_s"] = t
    return row
