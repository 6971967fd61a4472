"""The floor: a peak no plan can go below. Every plan runs each forward op once and each
backward op once, and keeping or recomputing changes neither what an op reads and makes nor
the step's constants (parameters, buffers, inputs) and the gradients made so far. So at
every op, those bytes are live in any plan, under the runtime's semantics
(``memplan.core.evaluate``): their sum at the worst op bounds every evaluated peak from
below. A budget under it is refused with that op named, not only with the least peak the
planners found."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.core import graph as g

STANDING = (g.PARAMETER, g.BUFFER, g.INPUT, g.GRADIENT)  # live from birth to death, any plan


@dataclass(frozen=True)
class Floor:
    """``floor_bytes`` live at event ``event`` in every plan; ``where`` names its op."""

    floor_bytes: int
    event: int
    where: str


def peak_floor(graph: g.Graph) -> Floor:
    """The largest, over the step's ops, of the standing values alive at the op plus the
    op's own inputs and outputs."""
    events = graph.ops + graph.backward_ops
    standing = [0] * (len(events) + 1)  # a difference array over events
    for v in graph.values:
        if v.kind in STANDING:
            standing[max(v.birth, 0)] += v.nbytes
            if v.death is not None:
                standing[v.death + 1] -= v.nbytes
    best, at, live = -1, 0, 0
    for e, op in enumerate(events):
        live += standing[e]
        own = sum(graph.values[v].nbytes for v in sorted(set(op.inputs) | set(op.outputs))
                  if graph.values[v].kind not in STANDING)
        if live + own > best:
            best, at = live + own, e
    return Floor(max(best, 0), at, event_label(graph, at))


def event_label(graph: g.Graph, event: int) -> str:
    """'forward op i (target in module)' or 'backward op j (target, gradient of module)'."""
    n = len(graph.ops)
    if event < n:
        op = graph.ops[event]
        return f"forward op {event} ({op.target} in '{op.module}')"
    op = graph.backward_ops[event - n]
    return f"backward op {event - n} ({op.target}, gradient of '{op.module}')"


__all__ = ["Floor", "event_label", "peak_floor"]
