"""The check that a unit's side run foresaw its backward in the model (``stamp``): after the
step, each first call's own backward, traced as always, must be its template's, renumbered.
A unit's backward can depend on what surrounds it (the strides autograd hands it, the nodes
that run between its own); the first call meets the model's surroundings, so a template that
disagrees with it is not trusted for the calls stamped from it."""

from __future__ import annotations

from typing import Any

from memplan.tracing.stamp_emit import vid
from memplan.tracing.stamp_template import NEW, Backward
from memplan.tracing.tracer import StepTracer


def foresaw(tracer: StepTracer, bwd: Backward, op0: int, f0: int, outer: list[int]) -> bool:
    """Whether the backward recorded for the first call at forward op ``op0`` (values from
    ``f0``, outer values ``outer``) is ``bwd`` (a template's), op for op, event for event."""
    hit = matched(tracer, bwd.ops, bwd.events, op0, f0, outer)
    if hit is None:
        return False
    ws, names = hit
    return all(tracer.values[names[c] if c >= NEW else f0 + c].death == ws + r
               for r, codes in bwd.deaths.items() for c in codes
               if c >= 0 and (c < NEW or c in names))


def matched(tracer: StepTracer, tmpl_ops: Any, events: list[tuple[int, int]], op0: int,
            f0: int, outer: list[int]) -> tuple[int, dict[int, int]] | None:
    """The traced backward of a call (forward ops from ``op0``, one per event, values from
    ``f0``, outer values ``outer``) against template records, op for op and event for event:
    (the window's first event, the value of each renamed code: new values, incoming
    gradients, running sums), or None where they differ."""
    ops = tracer.ops[op0:op0 + len(events)]
    starts = [op.unpack_event for op in ops if op.unpack_event >= 0]
    if not starts or len(ops) != len(events):
        return None
    ws, n_fwd = min(starts), len(tracer.ops)
    # (What follows the window may be the call's too: autograd adding its input's gradient
    # into a buffer shared with another consumer, as it would after a stamped call.)
    window = tracer.backward_ops[ws + 1 - n_fwd:ws + 1 - n_fwd + len(tmpl_ops)]
    if len(window) != len(tmpl_ops):
        return None
    names: dict[int, int] = {}

    def same(codes: list[int], vids: Any) -> bool:
        if len(codes) != len(vids):
            return False
        for c, v in zip(codes, vids):
            if c >= NEW or c <= -1 - len(outer):  # not the call's own values or arguments
                if names.setdefault(c, v) != v:
                    return False
            elif vid(c, f0, outer, 0) != v:
                return False
        return True

    for (target, inputs, outputs, mutated, flops, grad_of), b in zip(tmpl_ops, window):
        if (b.target, b.grad_of, b.fwd_flops) != (target, op0 + grad_of, flops) \
                or not same(inputs, b.inputs) or not same([NEW + c for c in outputs], b.outputs) \
                or not same(mutated, b.mutated):
            return None
    for op, (unpack, release) in zip(ops, events):
        if (op.unpack_event, op.release_event) != (
                -1 if unpack < 0 else ws + unpack, -1 if release < 0 else ws + release):
            return None
    return ws, names
