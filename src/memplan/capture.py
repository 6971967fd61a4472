"""``memplan.capture``: one training step as a :class:`~memplan.graph.Graph`, on fake tensors."""

from __future__ import annotations

import gc
from typing import Any

from memplan import graph as g
from memplan.step import LossFn, as_target, run_step
from memplan.tracer import StepTracer


def capture(model: Any, *inputs: Any, loss_fn: LossFn | None = None,
            device: str | None = None) -> g.Graph:
    """Capture a Workload (``memplan.models.get(...)``) or ``model, *inputs, loss_fn=...``.

    Runs forward, loss and backward once under ``FakeTensorMode`` (no real memory, so
    paper-scale models fit on a laptop) and records every aten op in order. ``device``
    (Workloads only; a user model is captured where its parameters are): kernels differ by
    device (e.g. attention on CUDA), so capture for the device you train on.
    """
    target = as_target(model, inputs, loss_fn)
    result = run_step(target, simulate=True, record=True, device=device)
    graph = build_graph(result.tracer, target.name, result.output_ids)
    n = result.tracer.model_ops
    graph.meta["forward"] = {
        "ops": n, "fingerprint": g.forward_fingerprint([o.target for o in graph.ops[:n]]),
        "inputs": result.input_specs, "autocast": autocast_state(),
    }
    del result
    gc.collect()  # the step's autograd graph and fake tensors: freed now, not during planning
    return graph


def autocast_state() -> dict[str, str]:
    """Devices with autocast on, and their dtypes: autocast changes the op sequence."""
    import torch

    out: dict[str, str] = {}
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                out[device] = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
        except (TypeError, RuntimeError):  # torch < 2.4 spells these differently
            pass
    return out


def build_graph(tracer: StepTracer, name: str, output_ids: tuple[int, ...]) -> g.Graph:
    values = tuple(
        g.Value(v.id, v.nbytes, v.kind, v.producer, v.birth, v.death, v.shape, v.dtype)
        for v in tracer.values
    )
    ops = tuple(_freeze(o) for o in tracer.ops)
    backward_ops = tuple(_freeze(o) for o in tracer.backward_ops)
    calls = tuple(sorted(tracer.module_calls, key=lambda c: (c.start, -c.end, c.depth)))
    cuts = cut_points(values, ops, calls, output_ids)
    meta = {"peak_bytes": tracer.peak_bytes, "forward_peak_bytes": tracer.forward_peak_bytes}
    return g.Graph(name, values, ops, backward_ops, cuts, calls, output_ids, meta)


def _freeze(o: Any) -> g.Op:
    return g.Op(
        o.index, o.target, o.module, tuple(o.inputs), tuple(o.outputs), tuple(o.mutated),
        tuple(o.saved), o.fwd_flops, o.bwd_flops, o.grad_of,
    )


def live_across(
    values: tuple[g.Value, ...], ops: tuple[g.Op, ...], output_ids: tuple[int, ...]
) -> list[list[int]]:
    """For each boundary after forward op i: activation values made at or before i and read
    (or written) by a later forward op, or returned by the forward."""
    n = len(ops)
    last_use: dict[int, int] = {}
    for op in ops:
        for vid in op.inputs + op.mutated:
            last_use[vid] = op.index
    for vid in output_ids:
        last_use[vid] = n
    starts: list[list[int]] = [[] for _ in range(n)]
    for v in values:
        if v.kind == g.ACTIVATION and v.producer >= 0 and last_use.get(v.id, -1) > v.producer:
            starts[v.producer].append(v.id)
    out: list[list[int]] = []
    live: dict[int, None] = {}
    for i in range(n):
        for vid in starts[i]:
            live[vid] = None
        for vid in [v for v in live if last_use[v] <= i]:
            del live[vid]
        out.append(sorted(live))
    return out


def cut_points(
    values: tuple[g.Value, ...],
    ops: tuple[g.Op, ...],
    calls: tuple[g.ModuleCall, ...],
    output_ids: tuple[int, ...],
) -> tuple[g.CutPoint, ...]:
    """Candidate stage boundaries (the paper's candidate set C in Alg. 3).

    The end of a non-leaf module call is a candidate when the call consumes everything that was
    live at its start (a residual block, an LSTM step, a decoder layer), or when no boundary
    inside the call has fewer live bytes (it narrows to its output, with long-lived values such
    as attention masks passing through). The end of the forward is always one.
    """
    if not ops:
        return ()
    live = live_across(values, ops, output_ids)
    live_bytes = [sum(values[v].nbytes for v in ids) for ids in live]
    chosen: dict[int, g.ModuleCall] = {}
    for call in calls:
        if call.end <= call.start:
            continue
        after = call.end - 1
        before = set(live[call.start - 1]) if call.start > 0 else set()
        closes = not before.intersection(live[after])
        interior = live_bytes[call.start : after]
        if not closes and interior and live_bytes[after] > min(interior):
            continue
        best = chosen.get(after)
        if best is None or call.depth > best.depth:
            chosen[after] = call
    last = len(ops) - 1
    result = [
        g.CutPoint(after, tuple(live[after]), live_bytes[after], call.path, call.depth)
        for after, call in sorted(chosen.items())
        if after != last
    ]
    result.append(g.CutPoint(last, tuple(live[last]), live_bytes[last], "<end>", 0))
    return tuple(result)
