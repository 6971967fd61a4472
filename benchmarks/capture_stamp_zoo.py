"""Trace-once-and-stamp on the zoo (issue 14, item 3): every entry captured stamped (the fast
path) and by the reference path (``fast=False``), the Graphs compared field by field; how
many calls were stamped, whether the capture fell back to no stamp, CPU seconds of each.
One process, 1 thread; an entry whose library is missing is skipped.

    PYTHONPATH=src:. .venv/bin/python benchmarks/capture_stamp_zoo.py [--only a,b]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import fields
from typing import Any

import torch
from tests.zoo import ZOO, installed, split

from memplan.core.graph import Graph
from memplan.tracing import capture, stamp
from memplan.tracing.step import as_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="entries, comma-separated (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    made: list[stamp.Stamper] = []
    steps: list[Any] = []
    init, run_step = stamp.Stamper.__init__, capture.run_step

    def keep(self: stamp.Stamper, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        made.append(self)

    def counted(*a: Any, **k: Any) -> Any:
        steps.append(k.get("stamp"))
        return run_step(*a, **k)

    setattr(stamp.Stamper, "__init__", keep)  # noqa: B010  (counted, for this benchmark)
    capture.run_step = counted
    differ = 0
    for name in args.only.split(",") if args.only else list(ZOO):
        entry = ZOO[name]
        if not installed(entry.library):
            print(f"{name:28s} skipped ({entry.library} not installed)")
            continue
        made.clear()
        steps.clear()
        graphs, cpu = [], []
        for fast in (True, False):
            model, example, loss = entry.build(0)
            inputs, kwargs = split(example)
            start = time.process_time()
            graphs.append(capture.capture_target(as_target(model, inputs, loss, kwargs),
                                                 fast=fast))
            cpu.append(time.process_time() - start)
        diff = [f.name for f in fields(Graph)
                if getattr(graphs[0], f.name) != getattr(graphs[1], f.name)]
        differ += bool(diff)
        fell = len(steps) == 3  # stamped, again unstamped (the fallback), the reference
        n = made[0].stamped + made[0].chains.stamped if made else 0  # units and chained calls
        print(f"{name:28s} stamped {n:3d}  "
              f"{'fell back' if fell else 'kept     '}  "
              f"{'EQUAL' if not diff else 'DIFFERS: ' + ','.join(diff)}  "
              f"cpu {cpu[0]:.2f} s vs reference {cpu[1]:.2f} s", flush=True)
    print(f"{differ} entries differ")


if __name__ == "__main__":
    main()
