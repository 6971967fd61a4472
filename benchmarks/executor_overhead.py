"""Issue 14 item 4: memplan's executor against torch's own checkpointing over the same units.

Small-op models, where the executor's per-op Python cost shows: a GPT (each block in its own
region vs every unit in a non-reentrant ``torch.utils.checkpoint``) and the LSTM (sqrt(T)
segments of steps in regions vs the same segments in ``checkpoint``, as
``checkpoint_sequential`` splits them). Both sides recompute the same ops and keep the same
boundaries; their peaks are measured and printed beside the times. Times: process CPU time
(and wall) of whole training steps, runs interleaved round-robin, medians, 1 thread. A fourth
column runs torch's checkpoint with early stop off, replaying whole units (memplan's replays
stop early, as torch's do by default).

Repeatable rows: capture leaves ~400k objects tracked by Python's garbage collector in this
process, so a full collection (~0.2 s) would land on whichever variant's step crosses the
threshold. After each case's set-up the objects alive are collected and frozen
(``gc.collect(); gc.freeze()``: a collection then walks only what the steps make), and the
rounds run the variants in the orders of a balanced Latin square (Williams), so each variant
follows each other equally often (the allocator's and caches' state a step leaves; a rotation
of one order kept each variant behind the same one in all rounds but one in n). The "paired"
column is the median over rounds of memplan's step CPU time over torch checkpoint's in the
same round: load that drifts over a run cancels out of it.

``--twin`` adds a control: a second, identical torch checkpoint model, and its paired ratio to
the first. Two instances of one variant differ only by chance (where their tensors lie, what
the other tenants of the machine did during their steps), so that ratio's distance from 1 is
the resolution of the paired column in that run: a memplan/torch ratio closer to 1 than it is
not a difference this run can show.

    .venv/bin/python benchmarks/executor_overhead.py [--device cpu|cuda] [--repeat 15]
        [--only gpt|lstm] [--twin] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

import memplan
from memplan.analysis.peers import _torch_segments, checkpoint_sequential_segments, peer_workload
from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.evaluate import evaluate, with_evaluation
from memplan.core.plan import make_plan
from memplan.models import Workload
from memplan.runtime.apply import apply
from memplan.runtime.probe import probe

GPT_SIZES = [  # (layers, d_model, seq_len): issue 14's small-op GPTs
    (4, 64, 64), (4, 128, 128), (6, 256, 256)]
LSTM_STEPS = [32, 64, 128]
GPT_FIXED = {"batch": 4, "heads": 4, "vocab": 1000}
LSTM_FIXED = {"batch": 16, "hidden": 256, "input": 50, "classes": 500}


def unit_plan(w: Workload, graph: memplan.Graph, unit_ends: list[int],
              recomputed: list[bool]) -> memplan.Plan:
    """The plan whose regions are the given units: a stage belongs to the first unit whose
    call ends after the stage's first op (``unit_ends``: op counts at the end of each unit's
    call); units with ``recomputed[k]`` False, and stages after the last unit (the loss),
    are kept. The LSTM's stages end mid-step (its chain has no cut point at a step's end):
    a stage across a segment's end goes to the segment's region, so memplan recomputes up
    to a stage more than torch's segment and keeps no more (by the stage's last op, it
    recomputed less and its peak was 0.03-0.3 MB above torch's)."""
    chain = C.build_chain(graph)
    assert graph.forward is not None
    n_model = graph.forward.ops

    def unit(s: int) -> int:
        start = int(chain.last[s - 1]) + 1 if s else 0
        for k, e in enumerate(unit_ends):
            if start < e:
                return k
        return len(unit_ends)

    items: list[S.Item] = []
    s = 0
    while s < chain.n:
        k = unit(s)
        e = s
        while e + 1 < chain.n and unit(e + 1) == k and int(chain.last[e + 1]) < n_model:
            e += 1
        if k < len(unit_ends) and recomputed[k] and int(chain.last[e]) < n_model:
            items.append(S.Region(s, e, tuple(S.Keep(t) for t in range(s, e + 1))))
        else:
            items.extend(S.Keep(t) for t in range(s, e + 1))
        s = e + 1
    plan = make_plan(chain, tuple(items), "units", {"units": len(unit_ends)}, None)
    # The runtime's peak and replay headroom, as memplan.plan gives them (its units use it).
    plan = with_evaluation(plan, evaluate(graph, plan))
    return dataclasses.replace(plan, forward=graph.forward)


def call_ends(model: nn.Module, inputs: tuple[Any, ...], paths: list[str]) -> list[int]:
    """Op counts at the end of each call of the modules ``paths``, in forward order."""
    ends = probe(model, inputs, watch=paths).call_ends
    return sorted(e for p in paths for e in ends[p])


def gpt_case(layers: int, d_model: int, seq_len: int) -> tuple[str, Workload, Workload,
                                                                 list[int], list[bool]]:
    w = memplan.models.get("gpt", layers=layers, d_model=d_model, seq_len=seq_len, **GPT_FIXED)
    model = w.build_model()
    paths = [f"net.blocks.{i}" for i in range(layers)] + ["net.head"]
    ends = call_ends(model, w.build_inputs(), paths)
    return (f"gpt {layers}L d{d_model} T{seq_len}", w, peer_workload(w, "per-block"), ends,
            [True] * len(ends))


def lstm_case(steps: int) -> tuple[str, Workload, Workload, list[int], list[bool]]:
    w = memplan.models.get("lstm", steps=steps, **LSTM_FIXED)
    model = w.build_model()
    step_ends = call_ends(model, w.build_inputs(), ["step"])
    bounds = _torch_segments(steps, checkpoint_sequential_segments(steps))
    ends = [step_ends[b - 1] for _, b in bounds]
    return (f"lstm T{steps}", w, peer_workload(w, "checkpoint_sequential"), ends,
            [b < steps for _, b in bounds])


class NoEarlyStop(nn.Module):
    """torch's checkpoint recomputing whole units: non-reentrant checkpoint stops a
    recomputation once the last tensor backward needs is saved (early stop, on by default),
    skipping e.g. a block's last matmul, and so does memplan's replay."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *inputs: Any) -> Any:
        with set_checkpoint_early_stop(False):
            return self.inner(*inputs)


def williams_orders(n: int) -> list[list[int]]:
    """Orders of n variants, one per round, in which each variant directly follows each other
    one equally often (a Williams design: n rows for even n, 2n for odd n)."""
    base = [0]
    low, high = 1, n - 1
    while len(base) < n:
        base.append(low if len(base) % 2 else high)
        if len(base) % 2:
            high -= 1
        else:
            low += 1
    rows = [[(b + i) % n for b in base] for i in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def timed(models: dict[str, nn.Module], inputs: tuple[Any, ...], loss: Any, repeat: int,
          cuda: bool) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median wall time of a step, and the process-CPU time of each timed round's step, runs
    interleaved, each round in the next order of ``williams_orders``."""
    wall: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    names = list(models)
    orders = williams_orders(len(names))
    for i in range(repeat + 2):  # two warm-up rounds
        for j in orders[i % len(orders)]:
            name = names[j]
            model = models[name]
            for p in model.parameters():
                p.grad = None
            if cuda:
                torch.cuda.synchronize()
            w0, c0 = time.perf_counter(), time.process_time()
            loss(model(*inputs)).backward()
            if cuda:
                torch.cuda.synchronize()
            w1, c1 = time.perf_counter(), time.process_time()
            if i >= 2:
                wall[name].append(w1 - w0)
                cpu[name].append(c1 - c0)
    return {k: statistics.median(v) for k, v in wall.items()}, cpu


TWIN = "torch checkpoint, twin"


def paired(cpu_runs: dict[str, list[float]], name: str) -> float:
    """Median over rounds of ``name``'s step CPU time over torch checkpoint's in that round."""
    return statistics.median(a / b for a, b in zip(cpu_runs[name], cpu_runs["torch checkpoint"]))


def run_case(case: tuple[str, Workload, Workload, list[int], list[bool]], dev: str,
             repeat: int, twin: bool = False) -> dict[str, Any]:
    name, w, peer, ends, recomputed = case
    graph = memplan.capture(w, device=dev)
    plan = unit_plan(w, graph, ends, recomputed)
    with torch.device(dev):
        inputs = w.build_inputs()
        models = {"plain": w.build_model(), "torch checkpoint": peer.build_model(),
                  "memplan": apply(w.build_model(), plan),
                  "torch, no early stop": NoEarlyStop(peer.build_model())}
        if twin:
            models[TWIN] = peer.build_model()
    peaks = {k: memplan.measure(m, *inputs, loss_fn=w.loss, simulate=False, device=dev,
                                repeat=1).peak_bytes for k, m in models.items()}
    gc.collect()
    gc.freeze()  # what set-up left is never walked again (see the module docstring)
    try:
        wall, cpu_runs = timed(models, inputs, w.loss, repeat, dev == "cuda")
    finally:
        gc.unfreeze()
    cpu = {k: statistics.median(v) for k, v in cpu_runs.items()}
    # memplan against torch round by round (steps run side by side), then the median: what
    # drifts over the run (load, frequency) cancels out
    ratio = paired(cpu_runs, "memplan")
    row = {"case": name, "peak_bytes": peaks, "wall_s": wall, "cpu_s": cpu,
           "predicted_peak_bytes": plan.peak_bytes, "regions": sum(recomputed),
           "cpu_runs_s": cpu_runs, "memplan_over_torch_cpu_paired": ratio}
    control = ""
    if twin:
        row["twin_over_torch_cpu_paired"] = paired(cpu_runs, TWIN)
        control = f" {row['twin_over_torch_cpu_paired']:.3f} |"
    print(f"| {name} | {cpu['plain'] * 1e3:.2f} ms | "
          f"{cpu['torch checkpoint'] / cpu['plain']:.3f}x | {cpu['memplan'] / cpu['plain']:.3f}x | "
          f"{cpu['torch, no early stop'] / cpu['plain']:.3f}x | {ratio:.3f} | "
          f"{wall['torch checkpoint'] / wall['plain']:.3f}x | {wall['memplan'] / wall['plain']:.3f}x | "
          f"{peaks['torch checkpoint'] / 1e6:.2f} / {peaks['memplan'] / 1e6:.2f} |{control}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["gpt", "lstm"], default=None)
    ap.add_argument("--twin", action="store_true",
                    help="add a second torch checkpoint model: the paired column's resolution")
    ap.add_argument("--out", default="out/executor")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = []
    if args.only in (None, "gpt"):
        cases += [gpt_case(*s) for s in GPT_SIZES]
    if args.only in (None, "lstm"):
        cases += [lstm_case(t) for t in LSTM_STEPS]
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, medians of "
          f"{args.repeat} interleaved steps; load {os.getloadavg()[0]:.2f}")
    control = (" twin / torch ckpt CPU, paired |", "---|") if args.twin else ("", "")
    print("| model | plain (CPU) | torch ckpt CPU | memplan CPU | torch no early stop CPU "
          "| memplan / torch ckpt CPU, paired | torch ckpt wall | memplan wall "
          f"| peak MB torch / memplan |{control[0]}\n|---|---|---|---|---|---|---|---|---|"
          f"{control[1]}")
    rows = [run_case(c, args.device, args.repeat, args.twin) for c in cases]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"executor_{args.device}.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
