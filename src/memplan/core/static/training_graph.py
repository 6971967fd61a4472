"""The training graph of one step and its memory-optimised mirror (paper Sec. 3, Alg. 2).

A :class:`TrainingGraph` is what the allocator (Fig. 2) sweeps: an execution order of steps,
each reading and creating *nodes* (feature-map storages with a size in bytes). Forward steps are
the captured forward ops; backward steps are the aten ops autograd ran in backward, each reading
only the forward values autograd saved for it (the paper's "declare the minimum dependencies",
Sec. 3). Parameters, their gradients, buffers and inputs are not feature maps (Sec. 5.1) and
are left out.

Given a mirror count m(v) per forward op (Sec. 4.1), Alg. 2 adds mirror nodes: op v is
duplicated m(v) times, the k-th copy reading the copies a[u] of its predecessors, and each
backward step reads the last copy a[v]. The order is Alg. 2's: the forward, then for each
backward step its not yet computed mirror ancestors in topological order, then the step.
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memplan.core import graph as g
from memplan.core.ops import is_pointwise, op_name
from memplan.errors import bad_arg

# Feature maps: what forward and backward ops make (Sec. 5.1 excludes weights and gradients).
FEATURE_MAP_KINDS = (g.ACTIVATION, g.BACKWARD)

@dataclass(frozen=True)
class Step:
    """One op of the execution order. ``kind`` is forward, mirror or backward; ``op`` indexes
    ``graph.ops`` (forward, mirror) or ``graph.backward_ops`` (backward)."""

    kind: str
    op: int
    level: int  # mirror level k (0 for forward and backward steps)
    inputs: tuple[int, ...]  # node ids read (deduplicated)
    outputs: tuple[int, ...]  # node ids created
    inplace_ok: bool  # may write an output over a same-sized input with no other pending use


@dataclass(frozen=True)
class TrainingGraph:
    """Nodes (feature-map storages) and the steps that make and read them, in order."""

    nbytes: tuple[int, ...]  # per node
    value: tuple[int, ...]  # per node: the graph value id it holds (a copy of it if level > 0)
    level: tuple[int, ...]  # per node: 0 = the original, k = made by the k-th mirror of its op
    steps: tuple[Step, ...]
    keep: tuple[int, ...]  # nodes alive after the step (the forward's outputs)
    mirror: tuple[int, ...]  # the plan: m(v) per forward op

    @property
    def n_recomputed(self) -> int:
        """Mirror steps: forward ops run again during backward."""
        return sum(1 for s in self.steps if s.kind == "mirror")

    def node_name(self, node: int, graph: g.Graph | None = None) -> str:
        """``v123`` or ``v123'`` (mirror copy), with its producer's module path when given."""
        name = f"v{self.value[node]}" + "'" * self.level[node]
        if graph is not None:
            prod = graph.values[self.value[node]].producer
            if prod >= 0:
                name += f" ({op_name(graph.ops[prod].target)} {graph.ops[prod].module})"
        return name


def check_mirror(graph: g.Graph, mirror: Sequence[int] | None) -> tuple[int, ...]:
    """Validate a mirror plan: one non-negative int per forward op; None = keep all."""
    n = len(graph.ops)
    if mirror is None:
        return (0,) * n
    if isinstance(mirror, (str, bytes)) or not isinstance(mirror, Sequence):
        raise bad_arg(
            "plan", f"a list of {n} ints (mirror count per forward op)", type(mirror).__name__,
            "Pass e.g. [0] * len(graph.ops), or a named plan.",
        )
    if len(mirror) != n:
        raise bad_arg(
            "plan", f"a list of {n} ints (one per forward op)", f"a list of {len(mirror)}",
            "Build the plan from this graph: len(plan) == len(graph.ops).",
        )
    bad = [m for m in mirror if not isinstance(m, int) or isinstance(m, bool) or m < 0]
    if bad:
        raise bad_arg(
            "plan", "mirror counts that are ints >= 0", bad[0],
            "Use 0 = keep, 1 = drop and recompute once, k > 1 = recursive.",
        )
    return tuple(mirror)


def training_graph(graph: g.Graph, mirror: Sequence[int] | None = None) -> TrainingGraph:
    """Alg. 2: the (memory-optimised) gradient graph of ``graph`` and its execution order."""
    b = _Builder(graph, check_mirror(graph, mirror))
    for v in graph.values:  # originals, in value order
        if b.fm[v.id]:
            b.new_node(v.id, 0)
    for op in graph.ops:
        b.forward_step(op)
    for bop in graph.backward_ops:
        b.backward_step(bop)
    keep = tuple(b.node[(x, 0)] for x in dict.fromkeys(graph.outputs) if b.fm[x])
    return TrainingGraph(tuple(b.nbytes), tuple(b.value), tuple(b.level), tuple(b.steps), keep,
                         b.m)


class _Builder:
    """Nodes and steps of the training graph, in the order Alg. 2 makes them."""

    def __init__(self, graph: g.Graph, m: tuple[int, ...]) -> None:
        self.graph, self.m = graph, m
        self.fm = [v.kind in FEATURE_MAP_KINDS for v in graph.values]
        self.prod = [v.producer if v.kind == g.ACTIVATION else -1 for v in graph.values]
        self.nbytes: list[int] = []
        self.value: list[int] = []
        self.level: list[int] = []
        self.node: dict[tuple[int, int], int] = {}  # (value id, level) -> node id
        self.steps: list[Step] = []
        self.done: set[tuple[int, int]] = set()  # mirror (op, k) already in the order

    def new_node(self, vid: int, lvl: int) -> int:
        self.node[(vid, lvl)] = len(self.nbytes)
        self.nbytes.append(self.graph.values[vid].nbytes)
        self.value.append(vid)
        self.level.append(lvl)
        return self.node[(vid, lvl)]

    def reads(self, op: g.Op) -> list[int]:
        return [x for x in dict.fromkeys(op.inputs + op.mutated) if self.fm[x]]

    def made(self, op: g.Op) -> list[int]:
        return [x for x in op.outputs if self.fm[x]]

    def forward_step(self, op: g.Op) -> None:
        ins = tuple(self.node[(x, 0)] for x in self.reads(op))
        outs = tuple(self.node[(x, 0)] for x in self.made(op))
        self.steps.append(Step("forward", op.index, 0, ins, outs, is_pointwise(op.target)))

    def pred_level(self, x: int, k: int) -> int:
        # Alg. 2: copy k of v reads a[u] as it stands in round k, i.e. copy min(m(u), k) of u.
        return min(self.m[self.prod[x]], k) if self.prod[x] >= 0 else 0

    def emit_ancestors(self, needed: list[tuple[int, int]]) -> None:
        """The mirror steps (op, copy k) in ``needed`` and the mirrors they read, not yet in
        the order, producers first."""
        prod = self.prod
        todo = [mk for mk in needed if mk not in self.done]
        found: dict[tuple[int, int], None] = {}
        while todo:
            i, k = todo.pop()
            if (i, k) in found:
                continue
            found[(i, k)] = None
            for x in self.reads(self.graph.ops[i]):
                lvl = self.pred_level(x, k)
                if lvl > 0 and (prod[x], lvl) not in self.done:
                    todo.append((prod[x], lvl))
        for i, k in sorted(found):  # producers precede consumers: a topological order
            op = self.graph.ops[i]
            ins = tuple(self.node[(x, self.pred_level(x, k))] for x in self.reads(op))
            outs = tuple(self.new_node(x, k) for x in self.made(op))
            self.steps.append(Step("mirror", i, k, ins, outs, is_pointwise(op.target)))
            self.done.add((i, k))

    def backward_step(self, bop: g.Op) -> None:
        """A backward step after the mirrors it needs: it reads the last copy a[v]."""
        m, prod = self.m, self.prod
        xs = self.reads(bop)
        self.emit_ancestors([(prod[x], m[prod[x]]) for x in xs
                             if prod[x] >= 0 and m[prod[x]] > 0])
        ins = tuple(self.node[(x, m[prod[x]] if prod[x] >= 0 else 0)] for x in xs)
        outs = tuple(self.node[(x, 0)] for x in self.made(bop))
        self.steps.append(Step("backward", bop.index, 0, ins, outs, is_pointwise(bop.target)))
