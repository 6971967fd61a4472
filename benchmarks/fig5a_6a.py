"""Reproduce the paper's Fig. 5a (ResNet depth sweep) and Fig. 6a (LSTM unroll sweep): static
feature-map memory per allocation strategy, from the planner alone (nothing is run).

    .venv/bin/python benchmarks/fig5a_6a.py --out out/fig5a_6a/

Writes fig5a_6a.csv, fig5a_6a.png (log-log) and summary.md into --out. Capturing is the slow
part (LSTM T=2048: minutes, on fake tensors); --graph-cache DIR keeps captured graphs as JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path
from typing import Any

from memplan.core.graph import Graph
from memplan.core.static.allocation import allocate
from memplan.core.static.mirror_plans import drop_bn_relu_plan, sqrt_plan
from memplan.core.static.training_graph import training_graph

GIB = 2**30
# Fig. 5a/6a legends -> (allocation strategy, mirror plan). "sublinear" is the sqrt(n)
# segmentation (mirror_plans.sqrt_plan) until the planners supply Alg. 3's best plan.
STRATEGIES: dict[str, tuple[str, Any]] = {
    "none": ("none", None),
    "inplace": ("inplace", None),
    "sharing": ("sharing", None),
    "drop bn-relu": ("sharing", drop_bn_relu_plan),
    "sublinear": ("sharing", sqrt_plan),
}
PAPER = {
    "resnet": "Fig. 5a (batch 32, 224x224): sharing cuts no-optimisation by 'a factor of two to "
    "three'; sharing still linear in depth; the sublinear plan 'gives a sub-linear trend'; "
    "ResNet-1000 trains in < 7 GB total GPU memory (Fig. 5b, runtime).",
    "lstm": "Fig. 6a (4 layers, hidden 1024, batch 64, input 50, 5000 classes): 'system "
    "optimization gives a lot of memory saving' on the fine-grained LSTM graph; the sublinear "
    "plan gives 'more than 4x reduction over the optimized plan'. No drop bn-relu curve.",
}


def get_graph(name: str, params: dict[str, int], cache: Path | None) -> tuple[Graph, float]:
    import memplan

    w = memplan.models.get(name, **params)
    path = None
    if cache is not None:
        path = cache / (w.spec.replace(":", "_").replace(",", "_") + ".json")
        if path.exists():
            return Graph.from_dict(json.loads(path.read_text())), 0.0
    t = time.perf_counter()
    graph = memplan.capture(w)
    seconds = time.perf_counter() - t
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(graph.to_json())
    return graph, seconds


def plan_all(graph: Graph, names: list[str]) -> tuple[list[dict[str, Any]], float]:
    """All strategies for one graph; returns rows and the planning seconds (capture excluded)."""
    rows = []
    t0 = time.perf_counter()
    plain = training_graph(graph)
    for label in names:
        strategy, make_plan = STRATEGIES[label]
        t = time.perf_counter()
        tg = plain if make_plan is None else training_graph(graph, make_plan(graph))
        a = allocate(tg, strategy)
        recompute = sum(graph.ops[s.op].fwd_flops for s in tg.steps if s.kind == "mirror")
        rows.append({
            "strategy": label,
            "total_bytes": a.total_bytes,
            "total_gib": round(a.total_bytes / GIB, 4),
            "peak_bytes": a.peak_bytes,
            "buffers": a.n_buffers,
            "recomputed_ops": tg.n_recomputed,
            "recompute_flops_pct": round(100 * recompute / max(1, graph.step_flops), 2),
            "plan_seconds": round(time.perf_counter() - t, 3),
        })
    return rows, time.perf_counter() - t0


def slope(xs: list[int], ys: list[int]) -> float:
    """Least-squares slope of log(y) against log(x): y ~ x^slope."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def sweep(model: str, key: str, sizes: list[int], base: dict[str, int], names: list[str],
          cache: Path | None, rows: list[dict[str, Any]]) -> str:
    """Plan every size; returns the ``none`` breakdown of the largest."""
    breakdown = ""
    for size in sizes:
        graph, cap_s = get_graph(model, {**base, key: size}, cache)
        breakdown = f"size {size}: {none_breakdown(graph)}"
        out, plan_s = plan_all(graph, names)
        print(f"{model} {key}={size}: capture {cap_s:.1f}s, {len(graph.ops)} fwd + "
              f"{len(graph.backward_ops)} bwd ops, planning {plan_s:.2f}s: "
              + ", ".join(f"{r['strategy']} {r['total_gib']:.3f}" for r in out) + " GiB",
              flush=True)
        for r in out:
            rows.append({"model": model, "size": size, "capture_seconds": round(cap_s, 1),
                         "all_strategies_seconds": round(plan_s, 3), **r})
    return breakdown


def none_breakdown(graph: Graph, top: int = 3) -> str:
    """The op types whose outputs make up most of the ``none`` total."""
    by: dict[str, int] = {}
    for phase, ops in (("forward", graph.ops), ("backward", graph.backward_ops)):
        for op in ops:
            made = sum(graph.values[v].nbytes for v in op.outputs
                       if graph.values[v].kind in ("activation", "backward"))
            key = f"{phase} {op.target}"
            by[key] = by.get(key, 0) + made
    total = sum(by.values())
    best = sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return ", ".join(f"{k} {100 * b / total:.0f}%" for k, b in best)


def comparisons(rows: list[dict[str, Any]], model: str) -> list[str]:
    get = {(r["size"], r["strategy"]): r["total_bytes"] for r in rows if r["model"] == model}
    sizes = sorted({r["size"] for r in rows if r["model"] == model})
    ratio = [get[(s, "none")] / get[(s, "sharing")] for s in sizes]
    gain = [get[(s, "sharing")] / get[(s, "sublinear")] for s in sizes]
    out = [f"- none/sharing: {min(ratio):.2f} .. {max(ratio):.2f} over sizes {sizes}",
           f"- sharing/sublinear: {min(gain):.2f} .. {max(gain):.2f}"]
    if len(sizes) >= 2:
        out.append(f"- sublinear log-log slope: "
                   f"{slope(sizes, [get[(s, 'sublinear')] for s in sizes]):.3f}")
    return out


def table(rows: list[dict[str, Any]], model: str, names: list[str]) -> list[str]:
    sizes = sorted({r["size"] for r in rows if r["model"] == model})
    get = {(r["size"], r["strategy"]): r for r in rows if r["model"] == model}
    lines = ["| size | " + " | ".join(f"{n} (GiB)" for n in names) + " | sharing/none | planning s |",
             "|---" * (len(names) + 3) + "|"]
    for s in sizes:
        cells = [f"{get[(s, n)]['total_gib']:.3f}" for n in names]
        ratio = get[(s, "none")]["total_bytes"] / get[(s, "sharing")]["total_bytes"]
        lines.append(f"| {s} | " + " | ".join(cells) + f" | 1/{ratio:.2f} | "
                     f"{get[(s, names[0])]['all_strategies_seconds']} |")
    fits = []
    for n in names:
        if len(sizes) >= 2:
            fits.append(f"{n} {slope(sizes, [get[(s, n)]['total_bytes'] for s in sizes]):.3f}")
    lines += ["", "Log-log slope vs size (least squares): " + ", ".join(fits)]
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, model, xlabel, title in (
        (axes[0], "resnet", "Number of layers", "(a) ResNet, Fig. 5a"),
        (axes[1], "lstm", "Number of unrolling steps", "(b) LSTM, Fig. 6a"),
    ):
        mine = [r for r in rows if r["model"] == model]
        for color, name in enumerate(STRATEGIES):
            pts = sorted((r["size"], r["total_bytes"] / GIB) for r in mine if r["strategy"] == name)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, color=f"C{color}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Feature map memory (GiB, static plan)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out/fig5a_6a"))
    ap.add_argument("--depths", default="128,256,512,1024")
    ap.add_argument("--steps", default="64,128,256,512,1024,2048")
    ap.add_argument("--timing-depth", type=int, default=1000,
                    help="ResNet depth for the all-strategies planning time (0 = skip)")
    ap.add_argument("--graph-cache", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny models, for a smoke test")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",") if d]
    steps = [int(t) for t in args.steps.split(",") if t]
    resnet_base = {"batch": 32}
    lstm_base: dict[str, int] = {}
    if args.quick:
        resnet_base = {"batch": 2, "image": 32}
        lstm_base = {"batch": 2, "hidden": 32, "input": 8, "classes": 10}
    rows: list[dict[str, Any]] = []
    resnet_names = list(STRATEGIES)
    lstm_names = [n for n in STRATEGIES if n != "drop bn-relu"]
    big = {
        "resnet": sweep("resnet", "depth", depths, resnet_base, resnet_names, args.graph_cache,
                        rows),
        "lstm": sweep("lstm", "steps", steps, lstm_base, lstm_names, args.graph_cache, rows),
    }
    timing = []
    if args.timing_depth:
        graph, _ = get_graph("resnet", {**resnet_base, "depth": args.timing_depth},
                             args.graph_cache)
        _, seconds = plan_all(graph, resnet_names)
        timing = [(f"Static planning of ResNet-{args.timing_depth} ({len(graph.ops)} forward, "
                   f"{len(graph.backward_ops)} backward ops), all five strategies: "
                   f"{seconds:.2f} s (capture excluded).")]
        print(timing[0])
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "fig5a_6a.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "fig5a_6a.png")
    summary = ["# Fig. 5a / 6a: static feature-map memory", "",
               ("Feature maps = activation and backward storages (parameters, their final "
                "gradients, buffers and inputs excluded, Sec. 5.1); bytes of all buffers of the "
                "static plan. 'sublinear' = sqrt(n) segments over the cut points (sqrt_plan)."),
               ""]
    for model, title, names in (("resnet", "ResNet (size = layers)", resnet_names),
                                ("lstm", "LSTM (size = unroll steps T)", lstm_names)):
        summary += [f"## {title}", "", *table(rows, model, names), "",
                    "Ours:", *comparisons(rows, model),
                    f"- largest parts of 'none' at {big[model]}", "",
                    "Paper: " + PAPER[model], ""]
        if model == "resnet":
            summary += [*timing, ""]
    (args.out / "summary.md").write_text("\n".join(summary))
    print("\n".join(summary))


if __name__ == "__main__":
    main()
