"""CUDA check (run on a GPU machine): exactness, allocator peak vs predicted peak, and step
time of plans applied with memplan, for the benchmark models at paper-like sizes.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/cuda_check.py [--out DIR] [--models gpt]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

import memplan

CASES: list[tuple[str, dict[str, Any]]] = [
    ("resnet", {"depth": 50, "batch": 32, "image": 224}),
    ("resnet", {"depth": 152, "batch": 32, "image": 224}),
    ("gpt", {"layers": 12, "seq_len": 1024, "batch": 8}),
    ("lstm", {"steps": 256}),
]


def plain_twice_equal(w: memplan.models.Workload) -> bool:
    """Is plain PyTorch itself bit-reproducible here? (the baseline for exactness)"""
    grads = []
    for _ in range(2):
        with torch.device("cuda"):
            model, x = w.build_model(), w.build_inputs()
        torch.manual_seed(1)
        w.loss(model(*x)).backward()
        grads.append([p.grad for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/cuda")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--models", nargs="*", default=None,
                    help="only these models (default: all of CASES)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    rows = []
    for name, params in CASES:
        if args.models and name not in args.models:
            continue
        w = memplan.models.get(name, **params)
        t0 = time.perf_counter()
        graph = memplan.capture(w, device="cuda")
        capture_s = time.perf_counter() - t0
        reproducible = plain_twice_equal(w)
        sqrt = memplan.plan(graph, planner="sqrt")
        plans = {"sqrt": sqrt,
                 "optimal@sqrt-peak": memplan.plan(graph, planner="optimal",
                                                   budget=sqrt.peak_bytes),
                 "optimal-least": memplan.plan(graph, planner="optimal")}
        for label, plan in plans.items():
            torch.cuda.empty_cache()
            rep = memplan.verify(w, plan, device="cuda", repeat=args.repeat)
            row = {"model": name, **params, "plan": label, "capture_s": capture_s,
                   "plain_reproducible": reproducible, "grads_equal": rep.grads_equal,
                   "max_abs_grad_diff": rep.max_abs_grad_diff,
                   "buffers_equal": rep.buffers_equal, "rng_equal": rep.rng_equal,
                   "predicted_peak_bytes": rep.predicted_peak_bytes,
                   "tracker_peak_bytes": rep.measured_peak_bytes,
                   "allocator_peak_bytes": rep.allocator_peak_bytes,
                   "plain_peak_bytes": rep.plain_peak_bytes,
                   "extra_flops_fraction": plan.extra_fraction,
                   "plain_step_s": rep.plain_step_s, "planned_step_s": rep.planned_step_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
            print(rep.summary(), flush=True)
    with open(os.path.join(args.out, "cuda_check.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
