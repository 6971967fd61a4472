"""A plan's recompute scopes on the captured graph, as the runtime makes them (for
``memplan.core.evaluate``, whose docstring states the semantics): which forward ops each scope
(a region, or a drop-cheap stage) covers, which saves become handles to it, which outside
tensors its tape keeps or copies, and which ops its replay runs (stopping early, as torch's
non-reentrant checkpoint does). Array arithmetic over the Graph's ``eval_arrays``, the same
for every plan. Pure (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.eval_arrays import COPY, KEEP, KIND, eval_arrays
from memplan.core.plan import Plan
from memplan.errors import PlanMismatch

I64 = npt.NDArray[np.int64]


@dataclass(eq=False)
class Scope:
    kind: str  # "region" | "drop-cheap"
    parent: Scope | None
    lo_op: int
    hi_op: int
    index: int  # scopes are numbered in preorder: a parent before its nested scopes
    children: list[Scope] = field(default_factory=list)

    @property
    def root(self) -> Scope:
        s = self
        while s.parent is not None:
            s = s.parent
        return s

    def subtree(self) -> list[Scope]:
        out = [self]
        for c in self.children:
            out += c.subtree()
        return out


def _ext(a: I64, fill: int = -1) -> I64:
    """``a`` with ``fill`` appended: indexing it with -1 (no scope) gives ``fill``."""
    return np.append(a, np.int64(fill))


class PlanScopes:
    """The scopes of ``plan`` on ``graph``, the saves that become handles to them, and what
    the runtime's tapes and replays do with them. Per scope arrays are indexed by
    ``Scope.index``; per value and per op arrays by value id and op index."""

    def __init__(self, graph: g.Graph, plan: Plan) -> None:
        self.g = graph
        self.a = a = eval_arrays(graph)
        self.n, self.n_events, self.n_model = a.n_ops, a.n_events, a.n_model
        self.scopes: list[Scope] = []
        self.scope_of_op = np.full(self.n, -1, dtype=np.int64)
        self._scopes(plan)
        sc = self.scopes
        self.lo = np.array([s.lo_op for s in sc], dtype=np.int64)
        self.hi = np.array([s.hi_op for s in sc], dtype=np.int64)
        self.parent = np.array([-1 if s.parent is None else s.parent.index for s in sc],
                               dtype=np.int64)
        self.root = np.array([s.root.index for s in sc], dtype=np.int64)
        self.drop_cheap = np.array([s.kind == "drop-cheap" for s in sc], dtype=np.bool_)
        self.root_of_op = _ext(self.root)[self.scope_of_op]
        made = (a.kind == KIND[g.ACTIVATION]) & (a.producer >= 0)
        producer = np.where(made, a.producer, 0)
        self.root_of_value = np.where(made, self.root_of_op[producer], -1)
        # An expensive op's output in a drop-cheap scope: its tape keeps it until it replays.
        self.held = (self.root_of_value >= 0) & np.append(self.drop_cheap, False)[
            self.root_of_value] & a.expensive[producer]
        self.native = self._classify_saves()
        self._subtree_totals()
        self._replayed_ops = self._replays()

    def _scopes(self, plan: Plan) -> None:
        stages = plan.stages

        def walk(items: tuple[S.Item, ...], parent: Scope | None) -> None:
            for it in items:
                if isinstance(it, S.Keep):
                    continue
                lo, hi = (it.stage, it.stage) if isinstance(it, S.DropCheap) else (it.start, it.end)
                kind = "drop-cheap" if isinstance(it, S.DropCheap) else "region"
                sc = Scope(kind, parent, stages[lo].first_op, stages[hi].last_op,
                           len(self.scopes))
                if sc.hi_op >= self.n_model:
                    raise PlanMismatch(f"the plan recomputes ops up to {sc.hi_op}, past the "
                                       f"model's forward ({self.n_model} ops)")
                self.scopes.append(sc)
                if parent is not None:
                    parent.children.append(sc)
                self.scope_of_op[sc.lo_op: sc.hi_op + 1] = sc.index
                if isinstance(it, S.Region):
                    walk(it.body, sc)

        walk(plan.schedule, None)

    def _classify_saves(self) -> I64:
        """Handles to scopes (``h_scope``, ``h_vid``, ``h_op``: the scope, the value, the
        saving op); returns the latest native release per value (-1: none). A save inside the
        value's top scope is a handle (unless its tape holds the value), owned by the
        outermost scope the value was made in from the saving op's scope up."""
        a = self.a
        vid, op = a.saved_vid, a.saved_op
        rv = self.root_of_value[vid]
        sc = self.scope_of_op[op]
        handle = (sc >= 0) & (_ext(self.root)[sc] == rv) & (rv >= 0) & ~self.held[vid]
        owner, producer = sc[handle], a.producer[vid[handle]]
        while True:
            par = _ext(self.parent)[owner]
            up = (par >= 0) & (producer < self.lo[owner])
            if not up.any():
                break
            owner = np.where(up, par, owner)
        self.h_scope, self.h_vid, self.h_op = owner, vid[handle], op[handle]
        native = np.full(len(a.kind), -1, dtype=np.int64)
        np.maximum.at(native, vid[~handle], a.release[op[~handle]])
        return native

    def _subtree_totals(self) -> None:
        """Per scope, over the handles of it and its nested scopes: whether it has any
        (``kept``), the first event that unpacks one (``trigger``, -1: none: it never
        replays) and the last release (``sub_release``, -1: none); per top scope, the event
        its tape dies at (``tape_death``: its last handle's release)."""
        k = len(self.scopes)
        unpack = self.a.unpack[self.h_op]
        first = np.full(k, self.n_events, dtype=np.int64)
        np.minimum.at(first, self.h_scope[unpack >= 0], unpack[unpack >= 0])
        last = np.full(k, -1, dtype=np.int64)
        np.maximum.at(last, self.h_scope, self.a.release[self.h_op])
        count = np.bincount(self.h_scope, minlength=k)
        for s in reversed(self.scopes):  # nested scopes after their parents
            if s.parent is not None:
                p = s.parent.index
                first[p], last[p] = min(first[p], first[s.index]), max(last[p], last[s.index])
                count[p] += count[s.index]
        self.kept = count > 0
        self.trigger = np.where(first < self.n_events, first, -1)
        self.sub_release = last
        self.tape_death = np.where(last >= 0, last, self.n_model - 1)

    # --- what the tapes keep ------------------------------------------------------------------

    def tape_reads(self) -> tuple[tuple[I64, I64, I64], tuple[I64, I64, I64]]:
        """Outside tensors each top scope's tape keeps, as (value, top scope, first reading
        op) arrays with one row per value read by the scope or more (take the least op), and
        the copies it makes of written ones: (op, top scope, value). A buffer an op writes in
        place (BatchNorm's ``num_batches_tracked += 1``) is copied too; the running statistics
        batch_norm writes never are (written only, never read back)."""
        a = self.a
        op, vid = a.input_op, a.inputs.item
        root = self.root_of_op[op]
        outside = (op < self.n_model) & (root >= 0) & (self.root_of_value[vid] != root)
        kept = outside & (a.tape_use == KEEP)
        copy = outside & (a.tape_use == COPY)
        return (vid[kept], root[kept], op[kept]), (op[copy], root[copy], vid[copy])

    # --- what replays run ---------------------------------------------------------------------

    def replayed_scopes(self) -> list[int]:
        """The scopes backward replays (their index): those with a handle (theirs or a nested
        scope's) that backward unpacks."""
        return [int(s) for s in np.flatnonzero(self.trigger >= 0)]

    def replayed(self, scope: int) -> I64:
        """The ops scope ``scope``'s replay runs: like torch's non-reentrant checkpoint, it
        stops once it has made every storage it gives back (its handles' values, its nested
        scopes' inputs), or last wrote one in place; a drop-cheap replay skips its expensive
        ops."""
        return self._replayed_ops[scope]

    def _replays(self) -> dict[int, I64]:
        a = self.a
        scopes = self.replayed_scopes()
        stash = [(s, v) for s in scopes for v in self.stash_values(s)]
        need_scope = np.concatenate([self.h_scope, np.array([s for s, _ in stash], np.int64)])
        need_vid = np.concatenate([self.h_vid, np.array([v for _, v in stash], np.int64)])
        end = np.full(len(self.scopes), -1, dtype=np.int64)
        for rel in (a.makers, a.writers):  # ops making the value, writing it in place
            i, op = rel.rows(need_vid)
            sc = need_scope[i]
            runs = (self.lo[sc] <= op) & (op <= self.hi[sc]) & ~(self.drop_cheap[sc]
                                                                 & a.expensive[op])
            np.maximum.at(end, sc[runs], op[runs])
        self.replay_last = end  # the last op a replay runs (-1: none)
        out: dict[int, I64] = {}
        for s in scopes:
            ops = np.arange(self.lo[s], end[s] + 1, dtype=np.int64)
            out[s] = ops[~a.expensive[ops]] if self.drop_cheap[s] else ops
        return out

    def stash_values(self, scope: int) -> I64:
        """Values made in ``scope`` that a nested scope kept alive (one with a handle in its
        subtree) reads from before it starts (``replay_intervals.stash_holds``)."""
        found = [self.reads_from(c.index, self.lo[scope], c.lo_op)
                 for c in self.scopes[scope].children if self.kept[c.index]]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)

    def reads_from(self, scope: int, lo: int, hi: int) -> I64:
        """Activations made by ops ``lo`` .. ``hi`` - 1 that ops of ``scope`` read."""
        a = self.a
        ptr = a.inputs.ptr
        vid = a.inputs.item[ptr[self.lo[scope]]: ptr[self.hi[scope] + 1]]
        p = a.producer[vid]
        out: I64 = vid[(a.kind[vid] == KIND[g.ACTIVATION]) & (lo <= p) & (p < hi)]
        return out


def depth_then_index(sc: Scope) -> tuple[int, int]:
    """The order replays triggered by one event run in: a scope's parents first."""
    depth = 0
    s: Scope | None = sc.parent
    while s is not None:
        depth += 1
        s = s.parent
    return depth, sc.index
