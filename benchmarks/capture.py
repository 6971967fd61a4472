"""Capture time (issue 14, item 3): ``memplan.capture`` of the paper's ResNet-1000 (batch 32;
as a Workload, built on the meta device inside capture, and ``resnet1000-user``: built with
real weights first, as a user builds it) and LSTM (T=1024, T=2048), and of loops users write
around torch's modules (``user_loops``: ``emb-lstm1024``, ``emb-gru1024``, ``universal48``,
``cells-lstm1024``/``cells-lstm2048``: the issue's own LSTM build), wall and process CPU
seconds, each run in a fresh process (the fake mode's cache is process-wide), 1 thread,
interleaved with the reference path (every op through the fake mode, ``--reference``),
medians; the load average beside each figure. Both paths must give the same graph fingerprint. ``--src`` times other source trees
too, interleaved (e.g. a worktree of an older commit: ``--src src,/work/wt/old/src``; the fast
path only, through the public ``memplan.capture``, which every layout has).

``--warm`` also times each capture in a process that has already paid torch's one-time costs:
``FakeTensorMode()`` imports ``torch._dynamo`` (about 1.9 s CPU here), and the fake mode's first
call of each op loads its decompositions and meta kernels. A tiny model of the same family is
captured first (same ops, other shapes: the fake mode's per-shape cache stays cold), so the
warm figure is capture's own work and cold minus warm is what any first fake-tensor run pays.

    .venv/bin/python benchmarks/capture.py [--models resnet1000,lstm1024] [--repeat 3]
        [--reference] [--warm] [--src src,OTHER/src] [--out capture.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "resnet1000": ("resnet", {"depth": 1000, "batch": 32}),
    # The same network built as a user builds it (real weights, before the timer) and passed
    # as ``capture(model, x, loss_fn=...)``: its parameters are made fake, not built fake.
    "resnet1000-user": ("real:resnet", {"depth": 1000, "batch": 32}),
    "lstm256": ("lstm", {"steps": 256}),
    "lstm1024": ("lstm", {"steps": 1024}),
    "lstm2048": ("lstm", {"steps": 2048}),
    # Loops users write around torch's modules (``user_loops``): --models emb-lstm1024,...
    "emb-lstm1024": ("user:emb-lstmcell", {"steps": 1024}),
    "emb-gru1024": ("user:emb-grucell", {"steps": 1024}),
    "universal48": ("user:universal", {"steps": 48}),
    # The paper's LSTM as issue 14 built it: a loop over nn.LSTMCell (68,611 ops at T=1024).
    "cells-lstm1024": ("user:paper-lstmcell", {"steps": 1024}),
    "cells-lstm2048": ("user:paper-lstmcell", {"steps": 2048}),
    # GNMT's residual stack: its upper layers' chains are left traced (their inputs' gradients
    # wait from a traced add), the bottom one's stamped.
    "residual-lstm256": ("user:residual-lstmcell", {"steps": 256}),
}
# --warm: a model of the same family, captured first in the process (tests/small.py's configs).
WARMUP: dict[str, dict[str, Any]] = {
    "resnet": {"depth": 14, "batch": 2, "image": 32, "classes": 10},
    "lstm": {"steps": 4, "batch": 2, "hidden": 32, "input": 8, "classes": 10},
    "real:resnet": {"depth": 14, "batch": 2, "image": 32, "classes": 10},
    "user:emb-lstmcell": {"steps": 3}, "user:emb-grucell": {"steps": 3},
    "user:universal": {"steps": 3}, "user:paper-lstmcell": {"steps": 3},
    "user:residual-lstmcell": {"steps": 3},
}

_RUN = """
import json, os, time, torch
torch.set_num_threads(1)
import memplan
def build(params):
    if {name!r}.startswith("user:"):
        import user_loops
        return user_loops.build({name!r}[5:], **params)
    if {name!r}.startswith("real:"):
        w = memplan.models.get({name!r}[5:], **params)
        x, y = w.build_inputs()
        return w.build_model().net, (x,), lambda out: torch.nn.functional.cross_entropy(out, y)
    return memplan.models.get({name!r}, **params), (), None
def capture(w):
    if {fast!r}:
        return memplan.capture(w[0], *w[1], loss_fn=w[2])
    from memplan.tracing.capture import capture_target
    from memplan.tracing.step import as_target
    return capture_target(as_target(*w), fast=False)
w = build({params!r})
if {warm!r}:
    capture(build({warmup!r}))
wall, cpu = time.perf_counter(), time.process_time()
g = capture(w)
print(json.dumps({{"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "fingerprint": g.fingerprint, "ops": len(g.ops),
                  "backward_ops": len(g.backward_ops), "load": os.getloadavg()[0]}}))
"""


def run_once(model: str, fast: bool, src: str | None = None, warm: bool = False
             ) -> dict[str, Any]:
    name, params = MODELS[model]
    return run_json(_RUN.format(name=name, params=params, fast=fast, warm=warm,
                                warmup=WARMUP[name]), src)


def run_json(code: str, src: str | None = None) -> dict[str, Any]:
    """Run ``code`` in a fresh process, 1 thread (``src``: a source tree to import memplan
    from), and return the JSON object its last output line prints."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    here = os.path.dirname(os.path.abspath(__file__))  # user_loops
    paths = [os.path.abspath(src)] if src is not None else []
    paths += [here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=env)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet1000,lstm1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also time the reference path")
    ap.add_argument("--warm", action="store_true",
                    help="also time captures after a warm-up capture in the same process")
    ap.add_argument("--src", default=None, help="source trees to time, comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    srcs = args.src.split(",") if args.src else [None]
    rows = []
    for model in args.models.split(","):
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.repeat):
            for src in srcs:
                for path in ("fast", "reference") if args.reference else ("fast",):
                    for warm in (False, True) if args.warm else (False,):
                        label = " ".join(
                            [path] + (["warm"] if warm else []) + ([src] if src else []))
                        r = run_once(model, path == "fast", src, warm)
                        runs.setdefault(label, []).append(r)
                        print(f"  {model} {label}: wall {r['wall_s']:.2f} s, "
                              f"cpu {r['cpu_s']:.2f} s, load {r['load']:.1f}", flush=True)
        for path, got in runs.items():
            if not got:
                continue
            row = {"model": model, "path": path, "runs": len(got),
                   "wall_s": statistics.median(r["wall_s"] for r in got),
                   "cpu_s": statistics.median(r["cpu_s"] for r in got),
                   "load": [round(r["load"], 1) for r in got],
                   "fingerprint": sorted({r["fingerprint"] for r in got}),
                   "ops": got[0]["ops"], "backward_ops": got[0]["backward_ops"]}
            rows.append(row)
            print(f"{model:11s} {path} wall {row['wall_s']:7.2f} s  cpu {row['cpu_s']:7.2f} s"
                  f"  load {row['load']}  fingerprint {row['fingerprint']}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
