"""The floor: a peak no plan can go below. Every plan runs each forward op once and each
backward op once, and keeping or recomputing changes neither what an op reads and makes nor
the step's constants (parameters, buffers, inputs) and the gradients made so far. So at
every op, those bytes are live in any plan, under the runtime's semantics
(``memplan.core.evaluate``): their sum at the worst op bounds every evaluated peak from
below. A budget under it is refused with that op named, not only with the least peak the
planners found."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.core import graph as g
from memplan.core.graph_arrays import NO_DEATH, flat, graph_arrays

STANDING = (g.PARAMETER, g.BUFFER, g.INPUT, g.GRADIENT)  # live from birth to death, any plan


@dataclass(frozen=True)
class Floor:
    """``floor_bytes`` live at event ``event`` in every plan; ``where`` names its op."""

    floor_bytes: int
    event: int
    where: str


def peak_floor(graph: g.Graph) -> Floor:
    """The largest, over the step's ops, of the standing values alive at the op plus the
    op's own inputs and outputs (vectorised: a 2048-step LSTM has 358k ops)."""
    events = graph.ops + graph.backward_ops
    n, nv = len(events), len(graph.values)
    if n == 0:
        return Floor(0, 0, "")
    ga = graph_arrays(graph)  # cached: planning builds it anyway
    nbytes = ga.nbytes
    standing = np.fromiter((v.kind in STANDING for v in graph.values), np.bool_, nv)
    birth = np.maximum(ga.birth, 0)
    death = np.where(ga.death == NO_DEATH, n, np.minimum(ga.death + 1, n))
    delta = np.zeros(n + 1, dtype=np.int64)  # standing bytes, a difference array over events
    np.add.at(delta, birth[standing], nbytes[standing])
    np.add.at(delta, death[standing], -nbytes[standing])
    live = np.cumsum(delta[:n])
    pairs = [flat(events, attr) for attr in ("inputs", "outputs")]
    keys = np.sort(np.concatenate([e * nv + v for e, v in pairs]))
    keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]  # each value once per op
    e, v = keys // nv, keys % nv
    mine = ~standing[v]
    own = np.zeros(n, dtype=np.int64)
    np.add.at(own, e[mine], nbytes[v[mine]])
    at = int(np.argmax(live + own))
    return Floor(int(live[at] + own[at]), at, event_label(graph, at))


def event_label(graph: g.Graph, event: int) -> str:
    """'forward op i (target in module)' or 'backward op j (target, gradient of module)'."""
    n = len(graph.ops)
    if event < n:
        op = graph.ops[event]
        return f"forward op {event} ({op.target} in '{op.module}')"
    op = graph.backward_ops[event - n]
    return f"backward op {event - n} ({op.target}, gradient of '{op.module}')"


__all__ = ["Floor", "event_label", "peak_floor"]
