"""The check that a unit's side run foresaw its backward in the model (``stamp``): after the
step, each first call's own backward, traced as always, must be its template's, renumbered.
A unit's backward can depend on what surrounds it (the strides autograd hands it, the nodes
that run between its own); the first call meets the model's surroundings, so a template that
disagrees with it is not trusted for the calls stamped from it."""

from __future__ import annotations

from typing import Any

from memplan.tracing.stamp_emit import vid
from memplan.tracing.stamp_template import NEW, Template
from memplan.tracing.tracer import StepTracer


def foresaw(tracer: StepTracer, template: Template, op0: int, f0: int, outer: list[int]) -> bool:
    """Whether the backward recorded for the first call at forward op ``op0`` (values from
    ``f0``, outer values ``outer``) is ``template``'s, op for op, event for event."""
    bwd = template.backward
    ops = tracer.ops[op0:op0 + len(bwd.events)]
    starts = [op.unpack_event for op in ops if op.unpack_event >= 0]
    if not starts or len(ops) != len(bwd.events):
        return False
    ws, n_fwd = min(starts), len(tracer.ops)
    # (What follows the window may be the unit's too: autograd adding its input's gradient
    # into a buffer shared with another consumer, as it would after a stamped call.)
    window = tracer.backward_ops[ws + 1 - n_fwd:ws + 1 - n_fwd + len(bwd.ops)]
    if len(window) != len(bwd.ops):
        return False
    names: dict[int, int] = {}  # code -> value, for the new values and the incoming gradient

    def same(codes: list[int], vids: Any) -> bool:
        if len(codes) != len(vids):
            return False
        for c, v in zip(codes, vids):
            if c >= NEW or c == -1 - len(outer):
                if names.setdefault(c, v) != v:
                    return False
            elif vid(c, f0, outer, 0) != v:
                return False
        return True

    for (target, inputs, outputs, mutated, flops, grad_of), b in zip(bwd.ops, window):
        if (b.target, b.grad_of, b.fwd_flops) != (target, op0 + grad_of, flops) \
                or not same(inputs, b.inputs) or not same([NEW + c for c in outputs], b.outputs) \
                or not same(mutated, b.mutated):
            return False
    for op, (unpack, release) in zip(ops, bwd.events):
        if (op.unpack_event, op.release_event) != (
                -1 if unpack < 0 else ws + unpack, -1 if release < 0 else ws + release):
            return False
    return all(tracer.values[names[c] if c >= NEW else f0 + c].death == ws + r
               for r, codes in bwd.deaths.items() for c in codes
               if c >= 0 and (c < NEW or c in names))
