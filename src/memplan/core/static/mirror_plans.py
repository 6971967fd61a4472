"""Mirror plans m(v) for Alg. 2: one mirror count per forward op (0 = keep, k = recompute k
times), what the static allocator (``allocation``) sweeps.

Any :class:`~memplan.core.plan.Plan` has one (``mirror_counts``): the allocator then measures
exactly the plan the runtime applies. The named plans are two planners' plans: ``drop-cheap``
(Sec. 4.2: recompute every op but conv/matmul, the runtime's op set) and ``sqrt`` (Sec. 4.3,
Alg. 1: about sqrt(n) segments).
"""

from __future__ import annotations

from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.graph_arrays import held_expensive, ints
from memplan.core.plan import Plan
from memplan.core.planners.sqrt import plan_sqrt


def drop_cheap_mirror(graph: g.Graph) -> list[int]:
    """Sec. 4.2: recompute the outputs of cheap ops (norms, activations, pooling, pointwise);
    keep those of expensive ones (``graph_arrays.held_expensive``)."""
    held = held_expensive(graph.ops, ints(graph.values, "producer"))
    return [0 if held[i] or not op.outputs else 1 for i, op in enumerate(graph.ops)]


def sqrt_mirror(graph: g.Graph) -> list[int]:
    """Sec. 4.3: the ``sqrt`` planner's segments, as mirror counts."""
    return mirror_counts(graph, plan_sqrt(graph))


def mirror_counts(graph: g.Graph, plan: Plan) -> list[int]:
    """m(v) per forward op of ``plan``: 0 in kept stages; in a region nested d deep, d for its
    ops and d - 1 for the values it hands on at its end (its checkpoint, kept by its parent);
    drop-cheap stages recompute their cheap ops once."""
    mirror = [0] * len(graph.ops)
    cut_at = {c.after: c for c in graph.cut_points}

    def walk(items: tuple[S.Item, ...], depth: int) -> None:
        for it in items:
            if isinstance(it, S.Keep):
                continue
            if isinstance(it, S.DropCheap):
                for i in plan.stages[it.stage].recompute_ops:
                    mirror[i] = max(mirror[i], 1)
                continue
            for s in range(it.start, it.end + 1):
                st = plan.stages[s]
                for i in range(st.first_op, st.last_op + 1):
                    mirror[i] = max(mirror[i], depth)
            walk(it.body, depth + 1)
            cut = cut_at.get(plan.stages[it.end].last_op)
            for vid in cut.live if cut is not None else ():
                op = graph.values[vid].producer
                if op >= 0:
                    mirror[op] = min(mirror[op], depth - 1)

    walk(plan.schedule, 1)
    return mirror
