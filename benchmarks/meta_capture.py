"""Plans from the meta device (a model larger than the machine): every zoo entry built under
``torch.device("meta")`` and captured on meta inputs, beside the same entry built on the CPU
and captured on the same path (transformers' trace path where the meta capture fell back to
it). "same graph": forward and backward ops and the peak are equal; "same forward": the meta
plan applies to the CPU model, but its backward or peak differs (kernels lay out gradients
by device); "differ": the forwards differ (first ops shown), and the plan does not apply.
One process, 1 thread; an entry whose library is missing is skipped.

    PYTHONPATH=src:. .venv/bin/python benchmarks/meta_capture.py [--only a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
from typing import Any

import torch
from tests.zoo import ZOO, installed, split

import memplan
from memplan.core.graph import Graph
from memplan.tracing.shims import trace_path


def _on_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _first_differences(meta: Graph, cpu: Graph, count: int = 4, backward: bool = False) -> str:
    a, b = ([o.target.removeprefix("aten.") for o in (g.backward_ops if backward else g.ops)]
            for g in (meta, cpu))
    lines = [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
             if line[:1] in "+-" and line[:3] not in ("---", "+++")]
    return " ".join(lines[:count])


def compare(name: str) -> str:
    entry = ZOO[name]
    try:
        with torch.device("meta"):
            model, example, loss = entry.build(0)
        inputs, kwargs = split(example)
        meta = memplan.capture(model, *map(_on_meta, inputs),
                               kwargs={k: _on_meta(v) for k, v in kwargs.items()}, loss_fn=loss)
    except Exception as err:  # noqa: BLE001  (what the meta device cannot build or run, shown)
        return f"not captured on meta | {type(err).__name__}: {str(err)[:90]}"
    assert meta.forward is not None
    path = "trace" if meta.forward.trace_path else "eager"
    model, example, loss = entry.build(0)
    inputs, kwargs = split(example)
    with trace_path() if meta.forward.trace_path else contextlib.nullcontext():
        cpu = memplan.capture(model, *inputs, kwargs=kwargs, loss_fn=loss)
    assert cpu.forward is not None
    peaks = f"peaks {meta.peak_bytes:,} / {cpu.peak_bytes:,} B"
    if meta.forward.fingerprint == cpu.forward.fingerprint:
        same_backward = ([o.target for o in meta.backward_ops]
                         == [o.target for o in cpu.backward_ops])
        if same_backward and meta.peak_bytes == cpu.peak_bytes:
            return f"same graph ({path} path) | {len(meta.ops)} ops, {peaks}"
        return f"same forward ({path} path) | {peaks}; backward: " \
               f"{_first_differences(meta, cpu, backward=True) or 'the same ops'}"
    return f"differ ({path} path) | {len(meta.ops)} / {len(cpu.ops)} ops: " \
           f"{_first_differences(meta, cpu)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="entries, comma-separated (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| entry | meta vs CPU | detail |\n|---|---|---|")
    counts: dict[str, int] = {}
    for name in args.only.split(",") if args.only else list(ZOO):
        if not installed(ZOO[name].library):
            continue
        status, detail = compare(name).split(" | ", 1)
        key = status.split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
        print(f"| {name} | {status} | {detail.replace('|', '/')} |", flush=True)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
