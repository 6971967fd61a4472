"""Executor benchmark: memplan's executor against plain PyTorch and hand-written
``torch.utils.checkpoint`` on the paper's ResNet at 50 layers (batch 8, 128x128), real steps,
interleaved runs, medians; then predicted vs measured peak for every planner on every
benchmark model.

    .venv/bin/python benchmarks/apply_overhead.py [--device cpu|cuda] [--repeat 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import memplan
from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.plan import make_plan
from memplan.runtime.apply import apply

GB = 1e9


class HandCheckpointed(nn.Module):
    """What a user writes by hand: the net's units in segments, each segment but the last in a
    non-reentrant checkpoint (``checkpoint_sequential``'s split), loss head plain."""

    def __init__(self, wrapped: nn.Module, segments: list[list[int]]) -> None:
        super().__init__()
        self.wrapped = wrapped
        net: Any = wrapped.net  # the zoo's ResNet: stem, stages of units, head
        self.units: list[nn.Module] = [net.stem] + [u for stage in net.stages for u in stage] \
            + [net.head]
        self.segments = segments

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for k, seg in enumerate(self.segments):
            mods = [self.units[i] for i in seg]

            def run(y: torch.Tensor, mods: list[nn.Module] = mods) -> torch.Tensor:
                for m in mods:
                    y = m(y)
                return y
            x = checkpoint(run, x, use_reentrant=False) if k < len(self.segments) - 1 else run(x)
        return nn.functional.cross_entropy(x, target, reduction="none")


def unit_segments(n_units: int, n_segments: int) -> list[list[int]]:
    """``checkpoint_sequential``'s split of n functions into segments."""
    size = n_units // n_segments
    out = [list(range(s, s + size)) for s in range(0, size * (n_segments - 1), size)]
    out.append(list(range(size * (n_segments - 1), n_units)))
    return out


def same_segments_plan(graph: memplan.Graph, model: nn.Module, segments: list[list[int]]
                       ) -> memplan.Plan:
    """The memplan plan whose regions are exactly the hand-written segments: chain stages
    grouped by the segment of the unit whose call ends them."""
    chain = C.build_chain(graph)
    net: Any = model.net
    paths = ["net.stem"] + [f"net.stages.{i}.{j}" for i, st in enumerate(net.stages)
                            for j in range(len(st))]
    segment_of = {path: k for k, seg in enumerate(segments) for u, path in enumerate(paths)
                  if u in seg}
    last = len(segments) - 1

    def seg(stage: int) -> int:  # a stage inside the last unit's call or after: the last
        module = chain.modules[stage]
        hits = [k for path, k in segment_of.items() if module == path or module.startswith(path + ".")]
        return hits[0] if hits else last

    items: list[S.Item] = []
    s = 0
    while s < chain.n:
        k = seg(s)
        e = s
        while e + 1 < chain.n and seg(e + 1) == k:
            e += 1
        if k < last:
            items.append(S.Region(s, e, tuple(S.Keep(t) for t in range(s, e + 1))))
        else:
            items.extend(S.Keep(t) for t in range(s, e + 1))
        s = e + 1
    plan = make_plan(chain, tuple(items), "hand-segments", {"segments": len(segments)}, None)
    return dataclasses.replace(plan, forward=graph.forward)


def timed(models: dict[str, nn.Module], inputs: tuple[Any, ...], loss: Any, repeat: int,
          device: str, clock: Any = time.perf_counter) -> dict[str, float]:
    """Median step time of interleaved runs (``clock``: wall, or process CPU time, which
    other processes on a shared machine disturb far less)."""
    cuda = device == "cuda"
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(repeat + 1):
        for name, model in models.items():
            for p in model.parameters():
                p.grad = None
            if cuda:
                torch.cuda.synchronize()
            t0 = clock()
            loss(model(*inputs)).backward()
            if cuda:
                torch.cuda.synchronize()
            if i:
                times[name].append(clock() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def peak(model: nn.Module, inputs: tuple[Any, ...], loss: Any, device: str) -> int:
    measured: int = memplan.measure(model, *inputs, loss_fn=loss, simulate=False,
                                    device=device, repeat=1).peak_bytes
    return measured


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=128)
    ap.add_argument("--out", default="out/apply")
    ap.add_argument("--skip-table", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    dev = args.device
    w = memplan.models.get("resnet", depth=50, batch=args.batch, image=args.image)
    graph = memplan.capture(w, device=dev)
    with torch.device(dev):
        plain = w.build_model()
        inputs = w.build_inputs()
    n_units = 2 + sum(len(s) for s in plain.net.stages)
    n_seg = max(1, round(n_units ** 0.5))
    segs = unit_segments(n_units, n_seg)
    hand = HandCheckpointed(w.build_model().to(dev), segs)
    same = apply(w.build_model().to(dev), same_segments_plan(graph, plain, segs))
    hand_peak = peak(hand, inputs, w.loss, dev)
    best_plan = memplan.plan(graph, planner="optimal", budget=hand_peak)
    best = apply(w.build_model().to(dev), best_plan)
    models = {"plain": plain, "hand checkpoint": hand, "memplan same segments": same,
              "memplan optimal @ hand peak": best}
    secs = timed(models, inputs, w.loss, args.repeat, dev)
    cpu = timed(models, inputs, w.loss, args.repeat, dev, time.process_time) if dev == "cpu" else secs
    peaks = {k: peak(m, inputs, w.loss, dev) for k, m in models.items()}
    rows: list[dict[str, Any]] = []
    for k in models:
        rows.append({"run": k, "step_s": secs[k], "vs_plain": secs[k] / secs["plain"],
                     "cpu_s": cpu[k], "cpu_vs_plain": cpu[k] / cpu["plain"],
                     "peak_bytes": peaks[k]})
    overhead = secs["memplan same segments"] / secs["hand checkpoint"] - 1
    cpu_overhead = cpu["memplan same segments"] / cpu["hand checkpoint"] - 1
    print(f"ResNet-50 batch {args.batch} {args.image}x{args.image} on {dev}, "
          f"{n_seg} segments of {n_units} units, medians of {args.repeat} interleaved steps")
    print(f"torch threads {torch.get_num_threads()}")
    print("| run | step time (wall) | vs plain | process CPU time | vs plain | peak (MB) |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['step_s'] * 1e3:.1f} ms | {r['vs_plain']:.3f}x | "
              f"{r['cpu_s'] * 1e3:.1f} ms | {r['cpu_vs_plain']:.3f}x | "
              f"{r['peak_bytes'] / 1e6:.1f} |")
    print(f"executor overhead vs hand-written checkpoint over the same segments: {overhead:+.2%}"
          f" wall, {cpu_overhead:+.2%} CPU time")
    print(f"optimal plan: predicted peak {best_plan.peak_bytes / 1e6:.1f} MB, extra "
          f"{best_plan.extra_fraction:.1%} of the step FLOPs")
    result: dict[str, Any] = {"resnet50": rows, "overhead_vs_hand": overhead,
                              "cpu_overhead_vs_hand": cpu_overhead}
    if not args.skip_table:
        result["predicted_vs_measured"] = predicted_vs_measured(dev)
    with open(os.path.join(args.out, f"apply_{dev}.json"), "w") as fh:
        json.dump(result, fh, indent=1)


BENCH = {
    "resnet": {"depth": 50, "batch": 8, "image": 128},
    "lstm": {"steps": 64, "batch": 16, "hidden": 512},
    "gpt": {"layers": 4, "d_model": 256, "heads": 4, "seq_len": 256, "batch": 4,
            "vocab": 8192},
}


def predicted_vs_measured(dev: str) -> list[dict[str, Any]]:
    print("\n| model | planner | predicted | measured | error |\n|---|---|---|---|---|")
    rows = []
    for name, params in BENCH.items():
        w = memplan.models.get(name, **params)
        graph = memplan.capture(w, device=dev)
        for planner in ("sqrt", "chen", "drop-cheap", "recursive", "optimal"):
            plan = memplan.plan(graph, planner=planner)
            with torch.device(dev):
                model = apply(w.build_model(), plan)
                inputs = w.build_inputs()
            measured = peak(model, inputs, w.loss, dev)
            err = measured / plan.peak_bytes - 1
            rows.append({"model": name, "planner": planner, "predicted": plan.peak_bytes,
                         "measured": measured, "error": err})
            print(f"| {name} | {planner} | {plan.peak_bytes / 1e6:.2f} MB | "
                  f"{measured / 1e6:.2f} MB | {err:+.2%} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
