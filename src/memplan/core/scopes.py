"""A plan's recompute scopes on the captured graph, as the runtime makes them (for
``memplan.core.evaluate``, whose docstring states the semantics): which forward ops each scope
(a region, or a drop-cheap stage) covers, which saves become handles to it, which outside
tensors its tape keeps or copies, and which ops its replay runs (stopping early, as torch's
non-reentrant checkpoint does). Pure (no torch).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.ops import is_expensive
from memplan.core.plan import Plan
from memplan.errors import PlanMismatch


@dataclass(eq=False)
class Scope:
    kind: str  # "region" | "drop-cheap"
    parent: Scope | None
    lo_op: int
    hi_op: int
    index: int
    handles: list[tuple[int, int]] = field(default_factory=list)  # (value, saving op)
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


class PlanScopes:
    """The scopes of ``plan`` on ``graph``, and what the runtime's tapes do with them."""

    def __init__(self, graph: g.Graph, plan: Plan) -> None:
        self.g = graph
        self.n = len(graph.ops)
        self.n_events = self.n + len(graph.backward_ops)
        self.n_model = graph.forward.ops if graph.forward is not None else self.n
        self.scopes: list[Scope] = []
        self.scope_of_op: list[Scope | None] = [None] * self.n
        self._scopes(plan)
        self.expensive = [is_expensive(op.target) for op in graph.ops]
        self._last_writes: dict[int, int] | None = None
        self._replayed_ops: dict[int, list[int]] = {}  # after classify_saves only
        self.savers: dict[int, list[int]] = defaultdict(list)
        for op in graph.ops:
            for vid in op.saved:
                self.savers[vid].append(op.index)

    # --- what the plan makes of the forward ---------------------------------------------------

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
                for o in range(sc.lo_op, sc.hi_op + 1):
                    self.scope_of_op[o] = sc
                if isinstance(it, S.Region):
                    walk(it.body, sc)

        walk(plan.schedule, None)

    def root_of_value(self, vid: int) -> Scope | None:
        v = self.g.values[vid]
        if v.kind != g.ACTIVATION or v.producer < 0:
            return None
        sc = self.scope_of_op[v.producer]
        return None if sc is None else sc.root

    def held(self, vid: int) -> bool:
        """An expensive op's output in a drop-cheap scope: its tape keeps it until it replays."""
        root = self.root_of_value(vid)
        return root is not None and root.kind == "drop-cheap" and self.expensive[
            self.g.values[vid].producer]

    def release(self, op: int) -> int:
        """The event after which the saves of forward op ``op`` are released."""
        r = self.g.ops[op].release_event
        return r if r >= 0 else self.n_events - 1  # its node never ran: freed with the graph

    def classify_saves(self) -> dict[int, int]:
        """Handles to scopes; returns the latest native release per value."""
        native: dict[int, int] = {}
        for vid, ops in self.savers.items():
            root = self.root_of_value(vid)
            held = self.held(vid)
            producer = self.g.values[vid].producer
            for o in ops:
                sc = self.scope_of_op[o]
                if sc is not None and sc.root is root and root is not None and not held:
                    owner = sc
                    while owner.parent is not None and producer < owner.lo_op:
                        owner = owner.parent
                    owner.handles.append((vid, o))
                else:
                    native[vid] = max(native.get(vid, -1), self.release(o))
        return native

    # --- what the tapes keep ------------------------------------------------------------------

    def tape_reads(self) -> tuple[dict[int, list[tuple[Scope, int]]],
                                  list[tuple[int, Scope, int]]]:
        """Outside tensors each top scope's tape keeps (value -> (scope, first reading op)),
        and the copies it makes of written ones: (op, scope, value). A buffer an op writes in
        place (BatchNorm's ``num_batches_tracked += 1``) is copied too; the running statistics
        batch_norm writes never are (written only, never read back)."""
        kept: dict[int, list[tuple[Scope, int]]] = defaultdict(list)
        copies: list[tuple[int, Scope, int]] = []
        values = self.g.values
        for o in range(self.n_model):
            sc = self.scope_of_op[o]
            if sc is None:
                continue
            root = sc.root
            op = self.g.ops[o]
            written = self.written(o)
            for vid in op.inputs:
                if self.root_of_value(vid) is root:
                    continue
                if vid in written and (values[vid].kind not in (g.PARAMETER, g.BUFFER) or (
                        vid in op.mutated and "batch_norm" not in op.target)):
                    copies.append((o, root, vid))
                elif values[vid].kind in (g.ACTIVATION, g.BACKWARD, g.EXTERNAL, g.INPUT) \
                        and not any(r is root for r, _ in kept[vid]):
                    kept[vid].append((root, o))
        return kept, copies

    def written(self, o: int) -> set[int]:
        """Values op ``o`` writes, as the runtime sees them (batch norm writes its running
        statistics without saying so in its schema)."""
        op = self.g.ops[o]
        out = set(op.mutated)
        if "batch_norm" in op.target:
            out.update(v for v in op.inputs if self.g.values[v].kind == g.BUFFER)
        return out

    def last_write(self) -> dict[int, int]:
        """The last forward op writing each value."""
        if self._last_writes is None:
            self._last_writes = {}
            for o in range(self.n):
                for vid in self.written(o):
                    self._last_writes[vid] = o
        return self._last_writes

    # --- what replays run ---------------------------------------------------------------------

    def replayed_scopes(self) -> list[Scope]:
        """The scopes backward replays: those with a handle (theirs or a nested scope's)
        that backward unpacks (after ``classify_saves``)."""
        return [sc for sc in self.scopes if any(
            self.g.ops[o].unpack_event >= 0 for s in sc.subtree() for _, o in s.handles)]

    def replayed(self, sc: Scope) -> list[int]:
        """The ops scope ``sc``'s replay runs: like torch's non-reentrant checkpoint, it stops
        once it has made every storage it gives back (its handles' values, its nested scopes'
        inputs), or last wrote one in place; a drop-cheap replay skips its expensive ops."""
        cached = self._replayed_ops.get(sc.index)
        if cached is not None:
            return cached
        ops = [o for o in range(sc.lo_op, sc.hi_op + 1)
               if sc.kind == "region" or not self.expensive[o]]
        needed = {vid for vid, _ in sc.handles} | self._stash_values(sc)
        end = -1
        for i, o in enumerate(ops):
            op = self.g.ops[o]
            if any(v in needed for v in op.outputs) or any(v in needed for v in op.mutated):
                end = i
        self._replayed_ops[sc.index] = ops[: end + 1]
        return ops[: end + 1]

    def _stash_values(self, sc: Scope) -> set[int]:
        """Values made in ``sc`` that a nested scope kept alive (one with a handle in its
        subtree) reads from before it starts (``replay_intervals.stash_holds``)."""
        out: set[int] = set()
        for child in sc.children:
            for d in child.subtree():
                if not any(s.handles for s in d.subtree()):
                    continue
                for o in range(d.lo_op, d.hi_op + 1):
                    for vid in self.g.ops[o].inputs:
                        v = self.g.values[vid]
                        if v.kind == g.ACTIVATION and sc.lo_op <= v.producer < child.lo_op:
                            out.add(vid)
        return out


def depth_then_index(sc: Scope) -> tuple[int, int]:
    """The order replays triggered by one event run in: a scope's parents first."""
    depth = 0
    s: Scope | None = sc.parent
    while s is not None:
        depth += 1
        s = s.parent
    return depth, sc.index
