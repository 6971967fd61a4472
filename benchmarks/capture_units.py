"""Repeated units in a captured step (issue 14, item 3): the facts a trace-once-and-stamp capture
must reproduce, read off a real capture of a small model.

For every call of a repeated unit (module calls whose path matches ``--units``), its backward
ops (those whose ``grad_of`` lies in the call's forward ops), with each ``add`` classified:

- ``L``: accumulation into a shared leaf's gradient buffer (autograd's InputBuffer of the
  weight's AccumulateGrad; the add's output ends, through further adds, as a ``.grad``): the
  first contribution to a buffer is stored without an op, later ones are added;
- ``a``: accumulation into another buffer holding a contribution from outside the unit (an
  output of the unit read downstream too, e.g. an LSTM step's (h, c) read by the next step).

Units with the same backward op sequence form a variant; the tool checks that the units of a
variant are equal up to renaming of values (inputs, outputs, ``grad_of`` offsets), that no
unit's backward is interrupted by another's ops, and that every add directly follows the
release of an autograd node (the engine adds a node's outputs into their buffers right after
running it). ``--show`` prints each variant's op sequence.

    PYTHONPATH=src .venv/bin/python benchmarks/capture_units.py --model lstm \\
        --params '{"steps": 6, "batch": 2, "hidden": 8, "input": 4, "classes": 5}' --units step
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from typing import Any

import torch

import memplan
from memplan.core import graph as g

DEFAULT_UNITS = {"lstm": r"step", "resnet": r"net\.stages\.\d+\.\d+", "gpt": r"net\.blocks\.\d+"}


def unit_runs(graph: g.Graph, calls: list[g.ModuleCall]) -> list[tuple[int | None, list[g.Op]]]:
    """The backward ops in order, cut into runs of one unit each (None: outside every unit)."""
    owner: dict[int, int] = {}
    for k, call in enumerate(calls):
        for i in range(call.start, call.end):
            owner.setdefault(i, k)
    runs: list[tuple[int | None, list[g.Op]]] = []
    for op in graph.backward_ops:
        unit = owner.get(op.grad_of) if op.grad_of >= 0 else None
        if not runs or runs[-1][0] != unit:
            runs.append((unit, []))
        runs[-1][1].append(op)
    return runs


def leaf_adds(graph: g.Graph) -> set[int]:
    """Backward ``add`` ops whose output ends, through further adds, as a parameter's grad."""
    gradients = {v.id for v in graph.values if v.kind == g.GRADIENT}
    consumers: dict[int, list[g.Op]] = defaultdict(list)
    adds = [op for op in graph.backward_ops if op.target == "aten.add.Tensor"]
    for op in adds:
        for v in op.inputs:
            consumers[v].append(op)
    ends: dict[int, bool] = {}
    for op in reversed(adds):  # an add's consumers come after it
        ends[op.outputs[0]] = op.outputs[0] in gradients or any(
            ends.get(c.outputs[0], False) for c in consumers[op.outputs[0]])
    return {op.index for op in adds if ends[op.outputs[0]]}


def canonical(ops: list[g.Op], start: int) -> list[tuple[Any, ...]]:
    """The ops with values renamed in order of first use and ``grad_of`` relative to ``start``."""
    names: dict[int, int] = {}
    return [(op.target, tuple(names.setdefault(v, len(names)) for v in op.inputs),
             tuple(names.setdefault(v, len(names)) for v in op.outputs), op.grad_of - start)
            for op in ops]


def adds_follow_releases(graph: g.Graph) -> bool:
    """Whether every backward add directly follows (after other adds) a node's release."""
    n = len(graph.ops)
    released = {op.release_event for op in graph.ops if op.release_event >= 0}
    for op in graph.backward_ops:
        if op.target != "aten.add.Tensor":
            continue
        k = op.index - 1
        while k >= 0 and graph.backward_ops[k].target == "aten.add.Tensor":
            k -= 1
        if n + k not in released:
            return False
    return True


def report(graph: g.Graph, pattern: str, show: bool) -> None:
    calls = [c for c in graph.module_calls if re.fullmatch(pattern, c.path)]
    runs = unit_runs(graph, calls)
    leaf = leaf_adds(graph)
    print(f"{graph.name}: {len(graph.ops)} forward ops, {len(graph.backward_ops)} backward ops, "
          f"{len(calls)} unit calls matching {pattern!r}")
    seen = [u for u, _ in runs if u is not None]
    print(f"  units whose backward is interrupted: {sorted({u for u in seen if seen.count(u) > 1})}")
    print(f"  every add directly follows a node's release: {adds_follow_releases(graph)}")
    variants: dict[tuple[str, ...], list[tuple[int, list[g.Op]]]] = defaultdict(list)
    for unit, ops in runs:
        if unit is not None:
            variants[tuple(op.target for op in ops)].append((unit, ops))
    for members in variants.values():
        unit0, ops0 = members[0]
        marks = "".join("L" if op.index in leaf else "a" if op.target == "aten.add.Tensor"
                        else "." for op in ops0)
        equal = all(canonical(ops, calls[u].start) == canonical(ops0, calls[unit0].start)
                    for u, ops in members)
        units = sorted(u for u, _ in members)
        print(f"  variant: {len(ops0)} backward ops, {marks.count('L')} leaf-buffer adds, "
              f"{marks.count('a')} other adds; units {units[:8]}"
              f"{' ...' if len(units) > 8 else ''} ({len(units)}); equal up to renaming: {equal}")
        print(f"    {marks}")
        if show:
            print("    " + " ".join(op.target.removeprefix("aten.") for op in ops0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lstm", choices=sorted(DEFAULT_UNITS))
    ap.add_argument("--params", default='{"steps": 6, "batch": 2, "hidden": 8, "input": 4, '
                                        '"classes": 5}', help="workload parameters (JSON)")
    ap.add_argument("--units", default=None, help="regex over module paths (default per model)")
    ap.add_argument("--show", action="store_true", help="print each variant's op sequence")
    args = ap.parse_args()
    torch.set_num_threads(1)
    graph = memplan.capture(memplan.models.get(args.model, **json.loads(args.params)))
    report(graph, args.units or DEFAULT_UNITS[args.model], args.show)


if __name__ == "__main__":
    main()
