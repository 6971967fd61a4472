"""``memplan demo`` (what ``make demo`` runs): the paper's headline, computed in the run.

1. The paper's 1000-layer ResNet (batch 32, 3x224x224, fp32), simulated on fake tensors:
   plain PyTorch vs torch's checkpoint_sequential with sqrt(n) segments vs memplan's sqrt and
   optimal plans (peak and extra compute), the optimal plan also measured after apply.
2. The paper's LSTM unrolled over 1024 steps: plain vs memplan's plans.
3. A small real CPU step, plain and under a plan: gradients and BatchNorm state compared.
4. A plot of ResNet memory vs depth, and where it went.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.table import Table

from memplan.commands import wide_console

GB = 1e9
Result = dict[str, Any]
FULL: dict[str, Any] = {"resnet": ({"batch": 32}, [128, 256, 512, 1000]), "lstm": ({}, 1024),
        "real": {"depth": 26, "batch": 4, "image": 64, "classes": 100}}
QUICK: dict[str, Any] = {"resnet": ({"batch": 2, "image": 32, "classes": 10}, [14, 26]),
         "lstm": ({"batch": 2, "hidden": 32, "input": 8, "classes": 10}, 8),
         "real": {"depth": 14, "batch": 2, "image": 32, "classes": 10}}


def _plans(graph: Any) -> dict[str, Any]:
    import memplan

    sqrt = memplan.plan(graph, planner="sqrt")
    return {"sqrt": sqrt, "optimal": memplan.plan(graph, planner="optimal",
                                                  budget=sqrt.peak_bytes)}


def _summary(plan: Any) -> Result:
    return {"peak": plan.peak_bytes, "extra_pct": 100 * plan.extra_fraction,
            "params": plan.params, "plain": plan.plain_peak_bytes}


def resnet_task(base: dict[str, Any], depths: list[int]) -> Result:
    """Plain/sqrt/optimal per depth; at the deepest also torch checkpoint_sequential, the
    least-peak plan and the optimal plan measured after apply (all simulated)."""
    import memplan
    from memplan.bench import applied_workload, apply_fn
    from memplan.peers import describe, peer_workload

    t0 = time.perf_counter()
    out: Result = {"sweep": []}
    for depth in depths:
        w = memplan.models.get("resnet", **base, depth=depth)
        graph = memplan.capture(w)
        plans = _plans(graph)
        out["sweep"].append({"depth": depth, "plain": int(graph.meta["peak_bytes"]),
                             **{k: _summary(p) for k, p in plans.items()}})
    out["least"] = _summary(memplan.plan(graph, planner="optimal"))
    out["peer"] = memplan.measure(peer_workload(w, "checkpoint_sequential")).peak_bytes
    out["peer_detail"] = describe(w, "checkpoint_sequential")
    apply = apply_fn()
    if apply is not None:
        try:
            out["applied"] = memplan.measure(applied_workload(w, plans["optimal"], apply)
                                             ).peak_bytes
        except memplan.MemplanError as err:
            out["applied_error"] = " ".join(str(err).split())
    out["seconds"] = time.perf_counter() - t0
    return out


def lstm_task(base: dict[str, Any], steps: int) -> Result:
    import memplan

    t0 = time.perf_counter()
    graph = memplan.capture(memplan.models.get("lstm", **base, steps=steps))
    out = {k: _summary(p) for k, p in _plans(graph).items()}
    return {**out, "plain": int(graph.meta["peak_bytes"]), "seconds": time.perf_counter() - t0}


def real_task(params: dict[str, Any]) -> Result:
    """One real CPU step plain and one under memplan's plan: memplan.verify when the build has
    it, else the same comparison done here with memplan.apply."""
    import torch

    import memplan

    torch.set_num_threads(1)  # bit-exact comparisons need a fixed thread count
    t0 = time.perf_counter()
    w = memplan.models.get("resnet", **params)
    plan = _plans(memplan.capture(w))["optimal"]
    try:
        return _real_check(w, plan, t0)
    except memplan.MemplanError as err:
        return {"spec": w.spec, "summary": f"failed: {' '.join(str(err).split())}", "ok": False,
                "seconds": time.perf_counter() - t0}


def _real_check(w: Any, plan: Any, t0: float) -> Result:
    import torch

    import memplan

    verify = getattr(memplan, "verify", None)
    if verify is not None:
        rep = verify(w, plan)
        return {"spec": w.spec, "summary": rep.summary(), "ok": bool(rep.ok),
                "seconds": time.perf_counter() - t0}
    apply = getattr(memplan, "apply", None)
    if apply is None:
        return {"spec": w.spec, "summary": "memplan.apply/verify are not in this build: no real "
                "run.", "ok": None, "seconds": time.perf_counter() - t0}
    inputs = w.build_inputs()
    plain, planned = w.build_model(), apply(w.build_model(), plan)
    for m in (plain, planned):
        w.loss(m(*inputs)).backward()
    grads = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(),
                                                             planned.parameters()))
    bufs = all(torch.equal(a, b) for a, b in zip(plain.buffers(), planned.buffers()))
    real_plain = memplan.measure(w, simulate=False, repeat=1).peak_bytes
    n = sum(1 for _ in plain.parameters())
    summary = (f"{w.spec}: {n} parameter gradients bit-identical: {grads}; BatchNorm running "
               f"stats identical: {bufs}; peak plain {real_plain / 2**20:.1f} MiB measured, "
               f"plan predicted {plan.peak_bytes / 2**20:.1f} MiB (memplan.verify not in this "
               "build: compared here with memplan.apply)")
    return {"spec": w.spec, "summary": summary, "ok": grads and bufs,
            "seconds": time.perf_counter() - t0}


def run_demo(jobs: int = 2, quick: bool = False, out: str = "out/demo") -> None:
    console = wide_console()
    cfg = QUICK if quick else FULL
    rbase, depths = cfg["resnet"]
    lbase, steps = cfg["lstm"]
    console.print("[bold]memplan demo[/bold]: the paper's models, one training step each "
                  "(simulated on fake tensors, fp32: nothing is allocated), then a real CPU "
                  f"step{' (--quick: tiny models)' if quick else ''}.\n")
    tasks: dict[str, tuple[Callable[..., Result], tuple[Any, ...]]] = {
        "lstm": (lstm_task, (lbase, steps)), "resnet": (resnet_task, (rbase, depths)),
        "real": (real_task, (cfg["real"],))}
    if jobs <= 1:
        with console.status("capturing and planning ..."):
            res = {k: fn(*a) for k, (fn, a) in tasks.items()}
    else:
        ctx = multiprocessing.get_context("spawn")
        with (console.status(f"capturing and planning in {jobs} worker processes ..."),
              ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool):
            futures = {k: pool.submit(fn, *a) for k, (fn, a) in tasks.items()}
            res = {k: f.result() for k, f in futures.items()}

    r = res["resnet"]
    top = r["sweep"][-1]
    table = _table(f"ResNet-{top['depth']} (batch {rbase.get('batch', 32)}, "
                   f"{rbase.get('image', 224)}x{rbase.get('image', 224)}): one training step")
    _row(table, "plain PyTorch", top["plain"], top["plain"], 0.0, "tracker")
    _row(table, f"torch checkpoint_sequential ({r['peer_detail']})", r["peer"], top["plain"],
         None, "tracker")
    _row(table, f"memplan sqrt ({top['sqrt']['params']['segments']} segments)",
         top["sqrt"]["peak"], top["plain"], top["sqrt"]["extra_pct"], "predicted")
    _row(table, "memplan optimal, at the sqrt plan's peak", top["optimal"]["peak"], top["plain"],
         top["optimal"]["extra_pct"], "predicted")
    if "applied" in r:
        _row(table, "  the same plan, measured after memplan.apply", r["applied"], top["plain"],
             top["optimal"]["extra_pct"], "tracker")
    elif "applied_error" in r:
        table.add_row("  the same plan after memplan.apply", "failed", "", "", "",
                      "(error below)")
    _row(table, "memplan optimal, least peak", r["least"]["peak"], top["plain"],
         r["least"]["extra_pct"], "predicted")
    console.print(table)
    if "applied_error" in r:
        console.print(f"  memplan.apply failed: {r['applied_error']}", markup=False)
    console.print("  paper (abstract, Sec. 5.2; MXNet on a Titan X): 48 GB -> 7 GB at 1000 "
                  "layers, ~30% more time per batch (Sec. 5.4)\n")

    lstm = res["lstm"]
    table = _table(f"LSTM unrolled over {steps} steps (4 x {lbase.get('hidden', 1024)}, batch "
                   f"{lbase.get('batch', 64)}): one training step")
    _row(table, "plain PyTorch", lstm["plain"], lstm["plain"], 0.0, "tracker")
    _row(table, f"memplan sqrt ({lstm['sqrt']['params']['segments']} segments)",
         lstm["sqrt"]["peak"], lstm["plain"], lstm["sqrt"]["extra_pct"], "predicted")
    _row(table, "memplan optimal, at the sqrt plan's peak", lstm["optimal"]["peak"],
         lstm["plain"], lstm["optimal"]["extra_pct"], "predicted")
    console.print(table)
    console.print("  paper (Sec. 5.3, Fig. 6): the sublinear plan needs more than 4x less "
                  "than the best plan without recomputation")
    console.print("  torch's checkpointing on the LSTM, measured: memplan bench lstm --peers\n")

    real = res["real"]
    mark = {True: "[green]OK[/green]", False: "[red]FAILED[/red]", None: "skipped"}[real["ok"]]
    console.print(f"[bold]Real CPU step[/bold] ({mark}): {real['summary']}", markup=True)
    png = plot(r["sweep"], Path(out))
    console.print(f"\nPlot of ResNet memory vs depth: {png}")
    console.print("Full reproduction of the paper's Fig. 5-7 (ours beside the paper's "
                  "numbers): memplan reproduce -> out/reproduce/; sweeps with peers: "
                  "memplan bench resnet --peers -> out/bench/")
    console.print("worker seconds: " + ", ".join(f"{k} {v['seconds']:.0f} s"
                                                 for k, v in res.items()))


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col, just in (("method", "left"), ("peak", "right"), ("peak (GB)", "right"),
                      ("less than plain", "right"), ("extra compute", "right"), ("peak is", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    return table


def _row(table: Table, label: str, peak: int, plain: int, extra_pct: float | None,
         how: str) -> None:
    from memplan.report import format_bytes

    extra = "~1 forward (not counted)" if extra_pct is None else f"{extra_pct:.1f}% of step"
    table.add_row(label, format_bytes(peak), f"{peak / GB:.2f}", f"{plain / peak:.1f}x", extra,
                  how)


def plot(sweep: list[Result], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    path = out / "resnet_memory_vs_depth.png"
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
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
    plt.close(fig)
    return path
