"""A lower bound on a trace-once-and-stamp capture (issue 14, item 3): the capture time left when
every repeated unit after its first call costs only its Python (ops through ``FakeOpCache`` with
the tracer paused: no autograd inside, no records) plus one custom autograd node.

``skeleton`` patches the zoo's unit classes in its own process: a ResNet ``Bottleneck`` whose
(input shape, stride, widths) was seen before, and every ``LSTMStep`` call after the first, run
inside one ``autograd.Function`` whose backward makes one fake grad per input that needs one
(none for the weights). What a real stamp adds on top -- the unit's records (ops, values,
saves, events) emitted from a template, its weights' grads, graph build and cut points for the
full graph -- is not in it: the figure is a floor, not an estimate. ``normal`` is
``memplan.capture`` unchanged. Fresh process per run, 1 thread, modes interleaved, medians;
``--warm`` captures a tiny model of the same family first (``benchmarks/capture.py --warm``).

    .venv/bin/python benchmarks/capture_stamp_bound.py [--models resnet1000,lstm1024]
        [--repeat 3] [--warm]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from capture import MODELS, WARMUP, run_json  # one table of models, one runner

_RUN = """
import json, os, time, torch
torch.set_num_threads(1)
import memplan
from memplan.models import lstm, resnet
from memplan.tracing import step as st

live = {{"tracer": None, "seen": set()}}
make_tracer = st.StepTracer.__init__
def tracer_init(self, *args, **kwargs):
    make_tracer(self, *args, **kwargs)
    live["tracer"] = self
    live["seen"] = set()
st.StepTracer.__init__ = tracer_init

def stamped(key):
    tracer = live["tracer"]
    if tracer is None or not tracer.record or key not in live["seen"]:
        live["seen"].add(key)
        return False
    return True

class Unit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *tensors):
        with live["tracer"].paused():
            out = run(*tensors)
        ctx.needs = [(t.shape, t.requires_grad) for t in tensors]
        return out
    @staticmethod
    def backward(ctx, *grads):
        return (None, *[torch.empty(shape) if needs else None for shape, needs in ctx.needs])

bottleneck = resnet.Bottleneck.forward
def bottleneck_stamped(self, x):
    key = (tuple(x.shape), self.conv2.stride, self.conv1.in_channels, self.conv3.out_channels)
    if not stamped(key):
        return bottleneck(self, x)
    return Unit.apply(lambda x: bottleneck(self, x), x)

step = lstm.LSTMStep.forward
def step_stamped(self, x, target, state, loss):
    if not stamped("step"):
        return step(self, x, target, state, loss)
    def run(x, target, loss, *hc):
        new_state, new_loss = step(self, x, target, list(zip(hc[::2], hc[1::2])), loss)
        return (new_loss, *[t for pair in new_state for t in pair])
    out = Unit.apply(run, x, target, loss, *[t for pair in state for t in pair])
    return list(zip(out[1::2], out[2::2])), out[0]

if {mode!r} == "skeleton":
    resnet.Bottleneck.forward = bottleneck_stamped
    lstm.LSTMStep.forward = step_stamped
if {warm!r}:
    memplan.capture(memplan.models.get({name!r}, **{warmup!r}))
wall, cpu = time.perf_counter(), time.process_time()
g = memplan.capture(memplan.models.get({name!r}, **{params!r}))
print(json.dumps({{"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "ops": len(g.ops), "backward_ops": len(g.backward_ops),
                  "load": os.getloadavg()[0]}}))
"""


def run_once(model: str, mode: str, warm: bool) -> dict[str, Any]:
    name, params = MODELS[model]
    return run_json(_RUN.format(name=name, params=params, warmup=WARMUP[name], mode=mode, warm=warm))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet1000,lstm1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warm", action="store_true")
    args = ap.parse_args()
    for model in args.models.split(","):
        runs: dict[str, list[dict[str, Any]]] = {"normal": [], "skeleton": []}
        for _ in range(args.repeat):
            for mode, got in runs.items():
                r = run_once(model, mode, args.warm)
                got.append(r)
                print(f"  {model} {mode}: cpu {r['cpu_s']:.2f} s, wall {r['wall_s']:.2f} s, "
                      f"ops {r['ops']}+{r['backward_ops']}, load {r['load']:.1f}", flush=True)
        for mode, got in runs.items():
            print(f"{model:11s} {mode:8s} {'warm' if args.warm else 'cold'} cpu "
                  f"{statistics.median(r['cpu_s'] for r in got):6.2f} s  wall "
                  f"{statistics.median(r['wall_s'] for r in got):6.2f} s  load "
                  f"{[round(r['load'], 1) for r in got]}", flush=True)


if __name__ == "__main__":
    main()
