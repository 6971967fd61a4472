"""``memplan.capture``: one training step as a :class:`~memplan.core.graph.Graph`, on fake tensors."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import torch

from memplan.core import graph as g
from memplan.core.liveness import cut_points
from memplan.tracing.stamp import StampMismatch
from memplan.tracing.step import (
    LossFn,
    Target,
    as_target,
    no_cyclic_gc,
    refuse_stray,
    run_step,
)
from memplan.tracing.tracer import StepTracer


def capture(model: Any, *inputs: Any, kwargs: Mapping[str, Any] | None = None,
            loss_fn: LossFn | None = None, device: str | None = None,
            **stray: Any) -> g.Graph:
    """Capture a Workload (``memplan.models.get(...)``) or ``model, *inputs, loss_fn=...``;
    ``kwargs``: inputs the forward takes by keyword (``model(*inputs, **kwargs)``; for a
    Hugging Face batch, ``kwargs=batch``).

    Runs forward, loss and backward once under ``FakeTensorMode`` (no real memory, so
    paper-scale models fit on a laptop) and records every aten op in order. ``device``
    (Workloads only; a user model is captured where its parameters are): kernels differ by
    device (e.g. attention on CUDA), so capture for the device you train on.
    """
    refuse_stray(capture, stray)
    return capture_target(as_target(model, inputs, loss_fn, kwargs), device)


def capture_target(target: Target, device: str | None = None, fast: bool = True) -> g.Graph:
    """``capture`` of a Target (``fast=False``: the reference path, see ``step.run_step``).
    The fast path stamps repeated module calls (``stamp``); where a stamp cannot be made
    equal to a trace, the whole step is captured again unstamped."""
    with no_cyclic_gc():  # until the Graph is built: see step.no_cyclic_gc
        try:
            result = run_step(target, simulate=True, record=True, device=device, fast=fast,
                              stamp=fast)
        except StampMismatch:
            result = run_step(target, simulate=True, record=True, device=device, fast=fast)
        tracer = result.tracer
        n = tracer.model_ops
        forward = g.ForwardSpec(n, g.forward_fingerprint([o.target for o in tracer.ops[:n]]),
                                tuple(result.input_specs), autocast_state(), result.notes,
                                result.kwarg_specs, result.answers or {}, result.trace_path)
        graph = build_graph(tracer, target.name, result.output_ids, forward, tracer.user_deaths)
        tracer.drop_records()
        del result, tracer
        # One full pass now, over the Graph and whatever the step left: the collector would
        # otherwise make it during planning (all of it is in the youngest generation). Made
        # while the collector is off: on again, it would first pass over the same objects.
        gc.collect()
    return graph


def autocast_state() -> dict[str, str]:
    """Devices with autocast on, and their dtypes: autocast changes the op sequence."""
    out: dict[str, str] = {}
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                out[device] = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
        except (TypeError, RuntimeError):  # torch < 2.4 spells these differently
            pass
    return out


def build_graph(tracer: StepTracer, name: str, output_ids: tuple[int, ...],
                forward: g.ForwardSpec | None, unsaved: dict[int, int] | None = None
                ) -> g.Graph:
    unsaved = unsaved or {}
    values = tuple(
        g.make_value(v.id, v.nbytes, v.kind, v.producer, v.birth, v.death, v.shape, v.dtype,
                     _earlier(unsaved.get(v.id), v.death))
        for v in tracer.values
    )
    ops = tuple(_freeze(o) for o in tracer.ops)
    backward_ops = tuple(_freeze(o) for o in tracer.backward_ops)
    calls = tuple(sorted(tracer.module_calls, key=lambda c: (c.start, -c.end, c.depth)))
    cuts = cut_points(values, ops, calls, output_ids)
    return g.Graph(name, values, ops, backward_ops, cuts, calls, output_ids, tracer.peak_bytes,
                   tracer.forward_peak_bytes, forward)


def _earlier(a: int | None, b: int | None) -> int | None:
    """The earlier of two deaths (None: alive after the step)."""
    if a is None:
        return b
    return a if b is None else min(a, b)


def _freeze(o: Any) -> g.Op:
    return g.make_op(
        o.index, o.target, o.module, tuple(o.inputs), tuple(o.outputs), tuple(o.mutated),
        tuple(o.saved), o.fwd_flops, o.bwd_flops, o.grad_of, o.unpack_event, o.release_event,
    )
