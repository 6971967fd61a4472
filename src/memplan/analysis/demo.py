"""The demo's work (``memplan demo`` shows it): the paper's headline, computed in the run.
ResNet memory vs depth (plain, sqrt, optimal, the least peak, torch's checkpoint_sequential,
the optimal plan measured after apply), the LSTM at a long unroll, and one real CPU step plain
vs planned compared by ``memplan.verify``."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from memplan import models
from memplan.analysis.bench import applied_workload
from memplan.analysis.peers import describe, peer_workload
from memplan.analysis.verify import verify
from memplan.api import plan as make_plan
from memplan.core.budget import GB
from memplan.core.graph import Graph
from memplan.core.plan import Plan
from memplan.errors import MemplanError
from memplan.tracing.capture import capture
from memplan.tracing.measure import measure

Result = dict[str, Any]
FULL: dict[str, Any] = {"resnet": ({"batch": 32}, [128, 256, 512, 1000]), "lstm": ({}, 1024),
        "real": {"depth": 26, "batch": 4, "image": 64, "classes": 100}}
QUICK: dict[str, Any] = {"resnet": ({"batch": 2, "image": 32, "classes": 10}, [14, 26]),
         "lstm": ({"batch": 2, "hidden": 32, "input": 8, "classes": 10}, 8),
         "real": {"depth": 14, "batch": 2, "image": 32, "classes": 10}}


def _plans(graph: Graph) -> dict[str, Plan]:
    sqrt = make_plan(graph, planner="sqrt")
    return {"sqrt": sqrt, "optimal": make_plan(graph, planner="optimal", budget=sqrt.peak_bytes)}


def _summary(plan: Any) -> Result:
    return {"peak": plan.peak_bytes, "extra_pct": 100 * plan.extra_fraction,
            "params": plan.params, "plain": plan.plain_peak_bytes}


def resnet_task(base: dict[str, Any], depths: list[int]) -> Result:
    """Plain/sqrt/optimal per depth; at the deepest also torch checkpoint_sequential, the
    least-peak plan and the optimal plan measured after apply (all simulated)."""
    t0 = time.perf_counter()
    out: Result = {"sweep": []}
    for depth in depths:
        w = models.get("resnet", **base, depth=depth)
        graph = capture(w)
        plans = _plans(graph)
        out["sweep"].append({"depth": depth, "plain": int(graph.peak_bytes),
                             **{k: _summary(p) for k, p in plans.items()}})
    out["least"] = _summary(make_plan(graph, planner="optimal"))
    out["peer"] = measure(peer_workload(w, "checkpoint_sequential")).peak_bytes
    out["peer_detail"] = describe(w, "checkpoint_sequential")
    try:
        out["applied"] = measure(applied_workload(w, plans["optimal"])).peak_bytes
    except MemplanError as err:
        out["applied_error"] = " ".join(str(err).split())
    out["seconds"] = time.perf_counter() - t0
    return out


def lstm_task(base: dict[str, Any], steps: int) -> Result:
    t0 = time.perf_counter()
    graph = capture(models.get("lstm", **base, steps=steps))
    out = {k: _summary(p) for k, p in _plans(graph).items()}
    return {**out, "plain": int(graph.peak_bytes), "seconds": time.perf_counter() - t0}


def real_task(params: dict[str, Any]) -> Result:
    """One real CPU step plain and one under memplan's plan (``memplan.verify``)."""
    torch.set_num_threads(1)  # bit-exact comparisons need a fixed thread count
    t0 = time.perf_counter()
    w = models.get("resnet", **params)
    try:
        rep = verify(w, _plans(capture(w))["optimal"])
    except MemplanError as err:
        return {"spec": w.spec, "summary": f"failed: {' '.join(str(err).split())}", "ok": False,
                "seconds": time.perf_counter() - t0}
    return {"spec": w.spec, "summary": rep.summary(), "ok": bool(rep.ok),
            "seconds": time.perf_counter() - t0}


def run_tasks(jobs: int, quick: bool) -> dict[str, Result]:
    """The demo's three tasks (ResNet sweep, LSTM, real step), in ``jobs`` spawn workers."""
    cfg = QUICK if quick else FULL
    rbase, depths = cfg["resnet"]
    lbase, steps = cfg["lstm"]
    tasks: dict[str, tuple[Callable[..., Result], tuple[Any, ...]]] = {
        "lstm": (lstm_task, (lbase, steps)), "resnet": (resnet_task, (rbase, depths)),
        "real": (real_task, (cfg["real"],))}
    if jobs <= 1:
        return {k: fn(*a) for k, (fn, a) in tasks.items()}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {k: pool.submit(fn, *a) for k, (fn, a) in tasks.items()}
        return {k: f.result() for k, f in futures.items()}


def plot(sweep: list[Result], out: Path) -> Path:
    """ResNet memory vs depth (cf. paper Fig. 5b), as a PNG in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "resnet_memory_vs_depth.png"
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    depths = [s["depth"] for s in sweep]
    for key, label in (("plain", "plain PyTorch (measured, simulated)"),
                       ("sqrt", "memplan sqrt (predicted)"),
                       ("optimal", "memplan optimal at sqrt's peak (predicted)")):
        ys = [(s[key] if key == "plain" else s[key]["peak"]) / GB for s in sweep]
        ax.plot(depths, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("layers")
    ax.set_ylabel("peak memory of one training step (GB)")
    ax.set_title("ResNet, memory vs depth (cf. paper Fig. 5b)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
