"""Where a capture's time goes (issue 14, item 3): the fake step's forward and backward CPU
seconds under each layer capture stacks on the model, and capture's own work after the step.

Each mode runs in a fresh process (1 thread), after a tiny model of the same family has run in
the same mode (torch's one-time costs paid, the fake mode's per-shape cache still cold, as
``benchmarks/capture.py --warm``); modes interleaved per round; medians.

- ``fake``: ``FakeTensorMode`` alone (every op through torch's fake dispatch).
- ``cached``: every op through memplan's ``FakeOpCache`` under a minimal dispatch mode that also
  answers ``prim.device`` (what any design pays that keeps autograd and one Python dispatch per
  op: the floor of per-op capture).
- ``count``: ``StepTracer(record=False)`` (``memplan.measure``'s step: live bytes per event).
- ``record``: ``run_step(record=True)``, capture's step (saves split into proxies, node hooks,
  module hooks, op records).
- ``capture``: ``memplan.capture``, split into its step, ``build_graph`` (less cut points), cut
  points and the closing ``gc.collect()``.

"forward" includes building the model on the meta device and making it fake (a Workload's
fast path), "backward" ends when the step returns.

    .venv/bin/python benchmarks/capture_floor.py [--models lstm256,resnet1000]
        [--modes fake,cached,count,record,capture] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from capture import MODELS, WARMUP, run_json  # one table of models, one runner

MODES = ("fake", "cached", "count", "record", "capture")

_RUN = """
import contextlib, gc, json, os, time, torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
torch.set_num_threads(1)
import memplan
from memplan.tracing import capture as cap, step as st
from memplan.tracing.fake import fake_mode, make_fake_in_place
from memplan.tracing.opcache import FakeOpCache
from memplan.tracing.tracer import StepTracer

DEVICE = torch.ops.prim.device.default

class Cached(TorchDispatchMode):
    def __init__(self, cache):
        super().__init__()
        self.cache = cache
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE and type(args[0]) is FakeTensor:
            return args[0].fake_device
        return self.cache.call(func, args, kwargs or {{}})

marks = {{}}
def mark(name):
    marks[name] = time.process_time()

def plain_step(w, cached):
    mark("start")
    with torch.device("meta"):
        model = w.build_model()
    with st.no_cyclic_gc(), fake_mode() as fake:
        make_fake_in_place(fake, model, torch.device("cpu"))
        inputs = w.build_inputs()
        with Cached(FakeOpCache(fake)) if cached else contextlib.nullcontext():
            loss = w.loss(model(*inputs))
            mark("forward")
            loss.backward()
        mark("backward")

end_forward = StepTracer.end_forward
def timed_end_forward(self):
    mark("forward")
    end_forward(self)
StepTracer.end_forward = timed_end_forward
run_step = st.run_step
def timed_run_step(*args, **kwargs):
    mark("start")
    out = run_step(*args, **kwargs)
    mark("backward")
    return out
cap.run_step = timed_run_step
parts = {{"build": 0.0, "cuts": 0.0, "gc": 0.0}}
def timed(name, fn):
    def call(*args, **kwargs):
        t = time.process_time()
        out = fn(*args, **kwargs)
        parts[name] += time.process_time() - t
        return out
    return call
cap.build_graph = timed("build", cap.build_graph)
cap.cut_points = timed("cuts", cap.cut_points)
gc.collect = timed("gc", gc.collect)  # capture_target's closing full pass

def one(w, mode):
    marks.clear()
    for k in parts:
        parts[k] = 0.0
    t0 = time.process_time()
    if mode in ("fake", "cached"):
        plain_step(w, mode == "cached")
    elif mode == "capture":
        memplan.capture(w)
    else:
        timed_run_step(st.as_target(w, (), None), simulate=True, record=mode == "record")
    return t0

one(memplan.models.get({name!r}, **{warmup!r}), {mode!r})
t0 = one(memplan.models.get({name!r}, **{params!r}), {mode!r})
total = time.process_time() - t0
out = {{"forward_s": marks["forward"] - marks["start"],
        "backward_s": marks["backward"] - marks["forward"], "total_s": total,
        "load": os.getloadavg()[0]}}
if {mode!r} == "capture":
    out.update({{k + "_s": v for k, v in parts.items()}})
    out["build_s"] -= out["cuts_s"]  # cut points are made inside build_graph
print(json.dumps(out))
"""


def run_once(model: str, mode: str) -> dict[str, Any]:
    name, params = MODELS[model]
    return run_json(_RUN.format(name=name, params=params, warmup=WARMUP[name], mode=mode))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lstm256,resnet1000")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    rows = []
    for model in args.models.split(","):
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for _ in range(args.repeat):
            for mode in modes:
                r = run_once(model, mode)
                runs[mode].append(r)
                print(f"  {model} {mode}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in r.items()), flush=True)
        for mode, got in runs.items():
            row: dict[str, Any] = {"model": model, "mode": mode, "runs": len(got)}
            for key in got[0]:
                if key != "load":
                    row[key] = round(statistics.median(r[key] for r in got), 2)
            row["load"] = [round(r["load"], 1) for r in got]
            rows.append(row)
            print(f"{model:11s} {mode:8s} " + "  ".join(
                f"{k} {v}" for k, v in row.items() if k not in ("model", "mode")), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
