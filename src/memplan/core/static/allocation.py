"""Static memory allocation of a training graph (paper Sec. 3, Fig. 2) and its feature-map bytes.

One sweep over the steps in execution order with a reference counter per node (the number of
steps still to read it). Strategies, as in Sec. 5.1:

- ``none``: every node gets its own buffer.
- ``inplace``: a pointwise step writes its output over a same-sized input whose counter is 1
  (this step is its last reader); otherwise a new buffer.
- ``sharing``: in-place, and buffers whose counter drops to 0 go back to a free pool (the
  "box of free tags") and are handed to later nodes.

The result is exact before anything runs: ``total_bytes`` is the sum of all buffers (the
paper's "feature map memory", Fig. 5a, 6a); ``peak_bytes`` is the most live data at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from memplan.core import graph as g
from memplan.core.plan import Plan
from memplan.core.static import mirror_plans
from memplan.core.static.training_graph import Step, TrainingGraph, training_graph
from memplan.errors import bad_arg

STRATEGIES = ("none", "inplace", "sharing")
PLANS = ("drop-cheap", "sqrt")  # named mirror plans; or a Plan, or m(v) per forward op
# A free buffer serves a request within this size ratio, growing if smaller (as MXNet's
# GraphAllocator, the paper's implementation, does).
MATCH_RANGE = 16


@dataclass(frozen=True)
class Allocation:
    """A buffer per node (-1 for 0-byte nodes), each buffer's size, and the totals."""

    strategy: str
    tg: TrainingGraph
    buffer_of: tuple[int, ...]  # per node
    buffer_bytes: tuple[int, ...]  # per buffer: the largest node it ever holds
    inplace_from: tuple[int, ...]  # per node: the input node whose buffer it took, or -1
    peak_bytes: int  # most bytes of live nodes at one step (an in-place pair counts once)
    peak_step: int

    @property
    def total_bytes(self) -> int:
        """Bytes of all buffers: what a static plan reserves for feature maps."""
        return sum(self.buffer_bytes)

    @property
    def n_buffers(self) -> int:
        return len(self.buffer_bytes)

    def buffers(self) -> list[list[int]]:
        """The assignment: for each buffer, the nodes it holds, in execution order."""
        out: list[list[int]] = [[] for _ in self.buffer_bytes]
        for step in self.tg.steps:
            for n in step.outputs:
                if self.buffer_of[n] >= 0:
                    out[self.buffer_of[n]].append(n)
        return out

    def describe(self, graph: g.Graph | None = None, limit: int = 20) -> str:
        """Largest buffers first, with the nodes sharing each (``'`` marks a mirror copy)."""
        lines = [
            (f"{self.strategy}: {self.n_buffers} buffers, total {self.total_bytes:,} B, "
             f"peak live {self.peak_bytes:,} B, {self.tg.n_recomputed} recomputed ops")
        ]
        groups = self.buffers()
        order = sorted(range(len(groups)), key=lambda b: (-self.buffer_bytes[b], b))
        for b in order[:limit]:
            names = [self.tg.node_name(n, graph) for n in groups[b]]
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} nodes)" if len(names) > 6 else "")
            lines.append(f"  buffer {b}: {self.buffer_bytes[b]:,} B <- {shown}")
        return "\n".join(lines)


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise bad_arg("strategy", f"one of {list(STRATEGIES)}", strategy,
                      "Use 'sharing' (all Sec. 3 optimisations), 'inplace' or 'none'.")


def allocate(tg: TrainingGraph, strategy: str = "sharing") -> Allocation:
    """Fig. 2: one O(n) sweep in execution order with a reference counter per node."""
    check_strategy(strategy)
    a = _Allocator(tg, strategy)
    for s, step in enumerate(tg.steps):
        donors = a.place(step)
        if a.live > a.peak:
            a.peak, a.peak_step = a.live, s
        a.free(step, donors)
    return Allocation(strategy, tg, tuple(a.buffer_of), tuple(a.sizes), tuple(a.inplace_from),
                      a.peak, a.peak_step)


class _Allocator:
    """The sweep's state: reference counts, buffers, the free pool, live bytes."""

    def __init__(self, tg: TrainingGraph, strategy: str) -> None:
        self.strategy = strategy
        self.nbytes = nbytes = tg.nbytes
        self.refs = [0] * len(nbytes)  # steps still to read each node (+1 if kept)
        for step in tg.steps:
            for n in step.inputs:
                self.refs[n] += 1
        for n in tg.keep:
            self.refs[n] += 1
        self.buffer_of = [-1] * len(nbytes)
        self.inplace_from = [-1] * len(nbytes)
        self.sizes: list[int] = []
        self.pool: list[tuple[int, int]] = []  # free (size, buffer), sorted
        self.live = self.peak = 0
        self.peak_step = -1

    def new_buffer(self, size: int) -> int:
        self.sizes.append(size)
        return len(self.sizes) - 1

    def request(self, size: int) -> int:
        pool = self.pool
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool) and pool[i][0] <= size * MATCH_RANGE:
            return pool.pop(i)[1]  # the smallest free buffer that fits
        if i > 0 and pool[i - 1][0] * MATCH_RANGE >= size:
            buf = pool.pop(i - 1)[1]  # the largest smaller one, grown
            self.sizes[buf] = size
            return buf
        return self.new_buffer(size)

    def release(self, n: int) -> None:
        if self.strategy == "sharing" and self.buffer_of[n] >= 0:
            bisect.insort(self.pool, (self.sizes[self.buffer_of[n]], self.buffer_of[n]))

    def place(self, step: Step) -> list[int]:
        """A buffer for each output of ``step``; returns the inputs it wrote over."""
        nbytes, refs, buffer_of = self.nbytes, self.refs, self.buffer_of
        donors: list[int] = []
        for out in step.outputs:
            size = nbytes[out]
            if size == 0:
                continue
            if self.strategy != "none" and step.inplace_ok:
                for x in step.inputs:  # Fig. 2: in-place when this step is x's last reader
                    if refs[x] == 1 and nbytes[x] == size and buffer_of[x] >= 0 and x not in donors:
                        donors.append(x)
                        self.inplace_from[out] = x
                        buffer_of[out] = buffer_of[x]
                        break
            if self.inplace_from[out] < 0:
                buffer_of[out] = (self.request(size) if self.strategy == "sharing"
                                  else self.new_buffer(size))
                self.live += size
        return donors

    def free(self, step: Step, donors: list[int]) -> None:
        """Count ``step``'s reads; nodes no step will read again give their buffer back."""
        for x in step.inputs:
            self.refs[x] -= 1
            if self.refs[x] == 0 and x not in donors:
                self.live -= self.nbytes[x]
                self.release(x)
        for out in step.outputs:
            if self.refs[out] == 0:  # made but never read
                self.live -= self.nbytes[out]
                self.release(out)


def resolve_plan(graph: g.Graph, plan: str | Plan | Sequence[int] | None) -> list[int] | None:
    """A named plan (``PLANS``), a Plan, a per-forward-op mirror list, or None (keep all)."""
    if plan is None:
        return None
    if isinstance(plan, Plan):
        return mirror_plans.mirror_counts(graph, plan)
    if isinstance(plan, str):
        if plan == "drop-cheap":
            return mirror_plans.drop_cheap_mirror(graph)
        if plan == "sqrt":
            return mirror_plans.sqrt_mirror(graph)
        raise bad_arg("plan", f"None, one of {list(PLANS)} or a list of ints per forward op",
                      plan, "Pass plan='sqrt' or a mirror list such as [0] * len(graph.ops).")
    return list(plan)


def plan_memory(graph: g.Graph, strategy: str = "sharing",
                plan: str | Plan | Sequence[int] | None = None) -> Allocation:
    """The static allocation of ``graph``'s training step under a mirror plan (``resolve_plan``);
    ``memplan.plan_memory`` is the front door that also takes a Workload."""
    check_strategy(strategy)
    return allocate(training_graph(graph, resolve_plan(graph, plan)), strategy)


def feature_map_bytes(graph: g.Graph, strategy: str = "sharing",
                      plan: str | Plan | Sequence[int] | None = None) -> int:
    """The paper's feature-map memory (Fig. 5a, 6a): bytes of all buffers of the static plan."""
    return plan_memory(graph, strategy, plan).total_bytes
