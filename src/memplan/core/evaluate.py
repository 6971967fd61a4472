"""A plan's memory under the runtime's own semantics, op by op on the captured graph: what a
``memplan.apply``-ed step holds at every forward op, backward op and replayed op. Pure (no
torch); the chain model (``memplan.core.chain``) is what planners optimise, this is what a
plan is held to (``api.plan`` never returns a plan whose evaluated peak exceeds its budget).

The runtime (``memplan.runtime.replay``), as modelled here:

* Stages outside recompute scopes run plainly. Every value dies when its last holder lets it
  go: the user's code (``Value.death_unsaved``), autograd's saves (released after the saving
  op's backward node ran, ``Op.release_event``), a tape. A tensor from outside the step
  counts from the first op that reads it (memplan's tracker sees it then).
* Inside a scope (a region, or a drop-cheap stage; nested regions share their top scope's
  tape) autograd gets a handle instead of a value made in the same top scope; a value made
  elsewhere is saved as it is. A tape keeps every outside tensor its ops read (a written one
  as a copy, held by every tape that read it before the write) until its last handle is
  released; a drop-cheap tape keeps its expensive ops' outputs until it replays.
* When backward first unpacks a handle (``Op.unpack_event``), its scope replays (a nested
  one after its parents) up to the last op that makes or writes a storage it gives back (a
  handle's, a nested scope's input): the rest of the scope is not run again, as torch's
  non-reentrant checkpoint stops early. Each replayed op makes new storages; one lives while a handle of
  it, a nested scope that takes it as input, or a later replayed op needs it, and an unneeded
  output until the next replayed op has run (the replay loop's own reference). An outside
  tensor a replayed op writes, or reads after a later write changed it, is copied for the op,
  and the copy lives while the replay uses it (its later readers, saves of it); a buffer's
  copy (BatchNorm's statistics) for its op (no unit holds a BatchNorm, ``runtime.probe``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.floor import event_label
from memplan.core.ops import is_expensive
from memplan.core.plan import Plan
from memplan.errors import PlanMismatch

NEVER = 1 << 62  # a death after every moment: alive after the step


@dataclass(frozen=True)
class Evaluation:
    """The evaluated step: its peak, the forward's peak, and where the peak is."""

    peak_bytes: int
    forward_peak_bytes: int
    peak_at: str


@dataclass(eq=False)
class _Scope:
    kind: str  # "region" | "drop-cheap"
    parent: _Scope | None
    lo_op: int
    hi_op: int
    index: int
    handles: list[tuple[int, int]] = field(default_factory=list)  # (value, saving op)
    children: list[_Scope] = field(default_factory=list)

    @property
    def root(self) -> _Scope:
        s = self
        while s.parent is not None:
            s = s.parent
        return s

    def subtree(self) -> list[_Scope]:
        out = [self]
        for c in self.children:
            out += c.subtree()
        return out


def evaluate(graph: g.Graph, plan: Plan) -> Evaluation:
    """The peak bytes of ``graph``'s step run under ``plan`` by the runtime (see the module
    docstring), exact to the byte where the runtime behaves as modelled."""
    if plan.graph_fingerprint != graph.fingerprint:
        raise PlanMismatch(f"the plan was made for graph {plan.graph_fingerprint}, not for "
                           f"{graph.fingerprint}: evaluate it on the graph it was made from.")
    return _Run(graph, plan).peak()


def idle_scopes(graph: g.Graph, plan: Plan) -> list[tuple[int, int]]:
    """Stage ranges (first, last) of the plan's recompute scopes that autograd would give no
    handle to (nothing they make is saved inside their top scope, nor in a nested one): the
    runtime never replays them, and keeping their stages plainly holds no more."""
    run = _Run(graph, plan)
    run._classify_saves()
    first_stage = {st.first_op: st.index for st in plan.stages}
    last_stage = {st.last_op: st.index for st in plan.stages}
    return [(first_stage[sc.lo_op], last_stage[sc.hi_op]) for sc in run.scopes
            if not any(s.handles for s in sc.subtree())]


def replay_counts(graph: g.Graph, plan: Plan) -> dict[int, int]:
    """How many times the runtime's replays run each forward op (absent: never) in one step
    under ``plan``: the recomputation the plan costs, early stops included."""
    run = _Run(graph, plan)
    run._classify_saves()
    out: dict[int, int] = defaultdict(int)
    for sc in run.replayed_scopes():
        for o in run._replayed(sc):
            out[o] += 1
    return dict(out)


class _Run:
    """One evaluation: scopes, the lifetimes of originals, replays, then a sweep."""

    def __init__(self, graph: g.Graph, plan: Plan) -> None:
        self.g = graph
        self.n = len(graph.ops)
        self.n_events = self.n + len(graph.backward_ops)
        self.n_model = graph.forward.ops if graph.forward is not None else self.n
        self.scopes: list[_Scope] = []
        self.scope_of_op: list[_Scope | None] = [None] * self.n
        self._scopes(plan)
        self.expensive = [is_expensive(op.target) for op in graph.ops]
        self._last_writes: dict[int, int] | None = None
        self._replayed_ops: dict[int, list[int]] = {}  # after _classify_saves only
        self.savers: dict[int, list[int]] = defaultdict(list)
        for op in graph.ops:
            for vid in op.saved:
                self.savers[vid].append(op.index)

    # --- what the plan makes of the forward ---------------------------------------------------

    def _scopes(self, plan: Plan) -> None:
        stages = plan.stages

        def walk(items: tuple[S.Item, ...], parent: _Scope | None) -> None:
            for it in items:
                if isinstance(it, S.Keep):
                    continue
                lo, hi = (it.stage, it.stage) if isinstance(it, S.DropCheap) else (it.start, it.end)
                kind = "drop-cheap" if isinstance(it, S.DropCheap) else "region"
                sc = _Scope(kind, parent, stages[lo].first_op, stages[hi].last_op,
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

    def _root_of_value(self, vid: int) -> _Scope | None:
        v = self.g.values[vid]
        if v.kind != g.ACTIVATION or v.producer < 0:
            return None
        sc = self.scope_of_op[v.producer]
        return None if sc is None else sc.root

    def _held(self, vid: int) -> bool:
        """An expensive op's output in a drop-cheap scope: its tape keeps it until it replays."""
        root = self._root_of_value(vid)
        return root is not None and root.kind == "drop-cheap" and self.expensive[
            self.g.values[vid].producer]

    def _release(self, op: int) -> int:
        """The event after which the saves of forward op ``op`` are released."""
        r = self.g.ops[op].release_event
        return r if r >= 0 else self.n_events - 1  # its node never ran: freed with the graph

    def _classify_saves(self) -> dict[int, int]:
        """Handles to scopes; returns the latest native release per value."""
        native: dict[int, int] = {}
        for vid, ops in self.savers.items():
            root = self._root_of_value(vid)
            held = self._held(vid)
            producer = self.g.values[vid].producer
            for o in ops:
                sc = self.scope_of_op[o]
                if sc is not None and sc.root is root and root is not None and not held:
                    owner = sc
                    while owner.parent is not None and producer < owner.lo_op:
                        owner = owner.parent
                    owner.handles.append((vid, o))
                else:
                    native[vid] = max(native.get(vid, -1), self._release(o))
        return native

    def _tape_reads(self) -> tuple[dict[int, list[tuple[_Scope, int]]],
                                   list[tuple[int, _Scope, int]]]:
        """Outside tensors each top scope's tape keeps (value -> (scope, first reading op)),
        and the copies it makes of written ones: (op, scope, value). A buffer an op writes in
        place (BatchNorm's ``num_batches_tracked += 1``) is copied too; the running statistics
        batch_norm writes never are (written only, never read back)."""
        kept: dict[int, list[tuple[_Scope, int]]] = defaultdict(list)
        copies: list[tuple[int, _Scope, int]] = []
        values = self.g.values
        for o in range(self.n_model):
            sc = self.scope_of_op[o]
            if sc is None:
                continue
            root = sc.root
            op = self.g.ops[o]
            written = self._written(o)
            for vid in op.inputs:
                if self._root_of_value(vid) is root:
                    continue
                if vid in written and (values[vid].kind not in (g.PARAMETER, g.BUFFER) or (
                        vid in op.mutated and "batch_norm" not in op.target)):
                    copies.append((o, root, vid))
                elif values[vid].kind in (g.ACTIVATION, g.BACKWARD, g.EXTERNAL, g.INPUT) \
                        and not any(r is root for r, _ in kept[vid]):
                    kept[vid].append((root, o))
        return kept, copies

    def _written(self, o: int) -> set[int]:
        """Values op ``o`` writes, as the runtime sees them (batch norm writes its running
        statistics without saying so in its schema)."""
        op = self.g.ops[o]
        out = set(op.mutated)
        if "batch_norm" in op.target:
            out.update(v for v in op.inputs if self.g.values[v].kind == g.BUFFER)
        return out

    # --- the sweep ----------------------------------------------------------------------------

    def peak(self) -> Evaluation:
        native = self._classify_saves()
        tape_kept, record_copies = self._tape_reads()
        trigger: dict[int, int] = {}
        for sc in self.scopes:
            unpacks = [self.g.ops[o].unpack_event for s in sc.subtree() for _, o in s.handles
                       if self.g.ops[o].unpack_event >= 0]
            if unpacks:
                trigger[sc.index] = min(unpacks)
        tape_death = {}
        for sc in self.scopes:
            if sc.parent is None:
                rel = [self._release(o) for s in sc.subtree() for _, o in s.handles]
                tape_death[sc.index] = max(rel) if rel else self.n_model - 1
        timeline = _Timeline(self.n_events, trigger, self.scopes, self._replayed)
        m = timeline.moment_of_event
        intervals: list[tuple[int, int, int]] = []  # (birth moment, death moment, bytes)

        def at(event: int | None) -> int:
            return NEVER if event is None else m[event]

        first_read = self._first_reads()
        for v in self.g.values:
            birth = m[v.birth] if v.birth >= 0 else 0
            if v.kind == g.EXTERNAL and v.birth < 0:
                if v.id not in first_read:
                    continue  # a scalar autograd wrapped: no op reads it, nothing tracks it
                birth = m[first_read[v.id]]  # a tensor from outside the step: seen from then
            if v.kind != g.ACTIVATION or v.producer < 0:  # a tape may keep it longer
                end = max([at(v.death)] + [m[tape_death[root.index]]
                                           for root, _ in tape_kept.get(v.id, ())])
                intervals.append((birth, end, v.nbytes))
                continue
            death = _earlier(v.death_unsaved, v.death)
            end = at(death)
            if v.id in native:
                end = max(end, m[native[v.id]])
            for root, _ in tape_kept.get(v.id, ()):
                end = max(end, m[tape_death[root.index]])
            held_by = self._root_of_value(v.id) if self._held(v.id) else None
            if held_by is not None:
                end = max(end, timeline.replay_end(held_by.index) if held_by.index in trigger
                          else m[tape_death[held_by.index]])
            intervals.append((birth, end, v.nbytes))
        for o, root, vid in record_copies:
            # One copy, held by every tape that read the value before the write.
            readers = [r for r, first in tape_kept.get(vid, ()) if first < o]
            intervals.append((m[o], max(m[tape_death[r.index]] for r in [root, *readers]),
                              self.g.values[vid].nbytes))
        for sc in self.replayed_scopes():
            intervals += self._replay(sc, timeline)
        return timeline.sweep(intervals, self.g)

    def replayed_scopes(self) -> list[_Scope]:
        """The scopes backward replays: those with a handle (theirs or a nested scope's)
        that backward unpacks (after ``_classify_saves``)."""
        return [sc for sc in self.scopes if any(
            self.g.ops[o].unpack_event >= 0 for s in sc.subtree() for _, o in s.handles)]

    def _first_reads(self) -> dict[int, int]:
        """The first event reading each value."""
        out: dict[int, int] = {}
        for e, op in enumerate(self.g.ops + self.g.backward_ops):
            for vid in op.inputs:
                out.setdefault(vid, e)
        return out

    # --- replays ------------------------------------------------------------------------------

    def _replayed(self, sc: _Scope) -> list[int]:
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

    def _stash_values(self, sc: _Scope) -> set[int]:
        """Values made in ``sc`` that a nested scope kept alive (one with a handle in its
        subtree) reads from before it starts (``_stash_holds``)."""
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

    def _replay(self, sc: _Scope, tl: _Timeline) -> list[tuple[int, int, int]]:
        """The storages scope ``sc``'s replay makes (and the copies it makes of written
        outside tensors), as (birth, death, bytes) in moments."""
        ops = self._replayed(sc)
        values = self.g.values
        root = sc.root
        last_read: dict[int, int] = {}  # value -> index in ops of its last replayed reader
        for i, o in enumerate(ops):
            for vid in self.g.ops[o].inputs:
                last_read[vid] = i
        handle_release: dict[int, int] = {}
        for vid, o in sc.handles:
            handle_release[vid] = max(handle_release.get(vid, -1), self._release(o))
        stash_until = self._stash_holds(sc, tl)
        out: list[tuple[int, int, int]] = []
        in_replay = set(ops)
        for i, o in enumerate(ops):
            main, pre = tl.replay_moments(sc.index, i)
            nxt = tl.replay_moments(sc.index, i + 1) if i + 1 < len(ops) else None
            written = self._written(o)
            for vid in written:
                if self._root_of_value(vid) is not root:
                    span = (pre, nxt[1] if nxt else main)
                    if values[vid].kind not in (g.BUFFER, g.PARAMETER):
                        span = (pre, max(span[1], self._copy_end(vid, i, ops, in_replay, tl,
                                                                 sc.index)))
                    out.append((*span, values[vid].nbytes))
            for vid in self.g.ops[o].inputs:
                if vid not in written and self._root_of_value(vid) is not root \
                        and values[vid].kind not in (g.PARAMETER, g.BUFFER) \
                        and self._last_write().get(vid, -1) > o:
                    # Read at a version changed since: replay reads a copy of the value it
                    # had (``replay._ext_value``), which lives while what it made from it does.
                    out.append((pre, max(nxt[1] if nxt else main,
                                         self._copy_end(vid, i, ops, in_replay, tl, sc.index)),
                                values[vid].nbytes))
            for vid in self.g.ops[o].outputs:
                end = tl.replay_moments(sc.index, i + 1)[0] if i + 1 < len(ops) else main
                if vid in last_read and last_read[vid] > i:
                    j = last_read[vid]
                    end = max(end, tl.replay_moments(sc.index, j + 1)[1] if j + 1 < len(ops)
                              else tl.replay_moments(sc.index, j)[0])
                if vid in handle_release:
                    end = max(end, tl.moment_of_event[handle_release[vid]])
                if vid in stash_until:
                    end = max(end, stash_until[vid])
                out.append((main, end, values[vid].nbytes))
        return out

    def _copy_end(self, vid: int, i: int, ops: list[int], in_replay: set[int], tl: _Timeline,
                  scope: int) -> int:
        """Until when a replay holds its copy of outside value ``vid`` made for its ``i``-th
        op: the copy stands in for the value in the replay (views of it, in-place results),
        so it lives until the replay's last reader of the value and the release of the saves
        of it by replayed ops (autograd saves the view the tape made, a handle)."""
        end = -1
        for j in range(len(ops) - 1, i, -1):
            if vid in self.g.ops[ops[j]].inputs:
                end = (tl.replay_moments(scope, j + 1)[1] if j + 1 < len(ops)
                       else tl.replay_moments(scope, j)[0])
                break
        releases = [self._release(o) for o in self.savers.get(vid, ()) if o in in_replay]
        if releases:
            end = max(end, tl.moment_of_event[max(releases)])
        return end

    def _last_write(self) -> dict[int, int]:
        """The last forward op writing each value."""
        if self._last_writes is None:
            self._last_writes = {}
            for o in range(self.n):
                for vid in self._written(o):
                    self._last_writes[vid] = o
        return self._last_writes

    def _stash_holds(self, sc: _Scope, tl: _Timeline) -> dict[int, int]:
        """Values made in ``sc`` before a nested scope starts that the nested scope (or one
        nested in it) reads: it takes them from ``sc``'s replay. The moment until which the
        last of them keeps one (the end of its replay, or its release)."""
        out: dict[int, int] = {}
        for child in sc.children:
            for d in child.subtree():
                if not any(s.handles for s in d.subtree()):
                    continue  # nobody kept this scope: it was released in the forward
                if d.index in tl.triggered:
                    until = tl.replay_end(d.index)
                else:
                    until = tl.moment_of_event[max(self._release(o) for s in d.subtree()
                                                   for _, o in s.handles)]
                for o in range(d.lo_op, d.hi_op + 1):
                    for vid in self.g.ops[o].inputs:
                        p = self.g.values[vid].producer
                        if self.g.values[vid].kind == g.ACTIVATION and sc.lo_op <= p < child.lo_op:
                            out[vid] = max(out.get(vid, -1), until)
        return out


class _Timeline:
    """Moments in step order: each event, and after an event the replays it triggers (a
    scope's parents first), each replayed op a moment (preceded by one for the copies of the
    outside tensors it writes)."""

    def __init__(self, n_events: int, trigger: dict[int, int], scopes: list[_Scope],
                 replayed: Callable[[_Scope], list[int]]) -> None:
        self.triggered = set(trigger)
        by_event: dict[int, list[_Scope]] = defaultdict(list)
        for sc in scopes:
            if sc.index in trigger:
                by_event[trigger[sc.index]].append(sc)
        self.moment_of_event = [0] * n_events
        self._replay: dict[int, list[tuple[int, int]]] = {}  # scope -> [(main, pre)] per op
        self._before: dict[int, int] = {}
        self.labels: list[str] = []
        moment = 0
        for e in range(n_events):
            self.moment_of_event[e] = moment
            self.labels.append(f"event {e}")
            moment += 1
            for sc in sorted(by_event.get(e, ()), key=_depth_then_index):
                ops = replayed(sc)
                slots = []
                for o in ops:
                    self.labels += [f"replay of ops {sc.lo_op}..{sc.hi_op}, before op {o}",
                                    f"replay of ops {sc.lo_op}..{sc.hi_op}, op {o}"]
                    slots.append((moment + 1, moment))
                    moment += 2
                self._replay[sc.index] = slots
                self._before[sc.index] = moment - 1  # an empty replay ends here
        self.n_moments = moment

    def replay_moments(self, scope: int, i: int) -> tuple[int, int]:
        """(main, pre) moments of the i-th replayed op of ``scope``."""
        return self._replay[scope][i]

    def replay_end(self, scope: int) -> int:
        slots = self._replay[scope]
        return slots[-1][0] if slots else self._before[scope]

    def sweep(self, intervals: list[tuple[int, int, int]], graph: g.Graph) -> Evaluation:
        delta = np.zeros(self.n_moments + 1, dtype=np.int64)
        for birth, death, nbytes in intervals:
            if death < birth:
                continue
            delta[birth] += nbytes
            delta[min(death, self.n_moments - 1) + 1] -= nbytes
        live = np.cumsum(delta[:-1])
        at = int(np.argmax(live))
        fwd_end = self.moment_of_event[len(graph.ops) - 1] + 1 if graph.ops else 0
        fwd_peak = int(live[:fwd_end].max()) if fwd_end else 0
        return Evaluation(int(live[at]), fwd_peak, self._where(at, graph))

    def _where(self, moment: int, graph: g.Graph) -> str:
        label = self.labels[moment]
        if label.startswith("event "):
            return event_label(graph, int(label.split()[1]))
        return label


def _depth_then_index(sc: _Scope) -> tuple[int, int]:
    depth = 0
    s: _Scope | None = sc.parent
    while s is not None:
        depth += 1
        s = s.parent
    return depth, sc.index


def _earlier(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


__all__ = ["Evaluation", "evaluate", "idle_scopes", "replay_counts"]
