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

This module adds up the step's values; ``scopes`` (what the plan makes of the forward),
``timeline`` (the moments, replays included) and ``replay_intervals`` (what replays make)
hold the rest.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from memplan.core import graph as g
from memplan.core.plan import Plan
from memplan.core.replay_intervals import replay_intervals
from memplan.core.scopes import PlanScopes
from memplan.core.timeline import NEVER, Interval, Timeline
from memplan.errors import PlanMismatch


@dataclass(frozen=True)
class Evaluation:
    """The evaluated step: its peak, the forward's peak, and where the peak is."""

    peak_bytes: int
    forward_peak_bytes: int
    peak_at: str


def evaluate(graph: g.Graph, plan: Plan) -> Evaluation:
    """The peak bytes of ``graph``'s step run under ``plan`` by the runtime (see the module
    docstring), exact to the byte where the runtime behaves as modelled."""
    if plan.graph_fingerprint != graph.fingerprint:
        raise PlanMismatch(f"the plan was made for graph {plan.graph_fingerprint}, not for "
                           f"{graph.fingerprint}: evaluate it on the graph it was made from.")
    return _peak(PlanScopes(graph, plan))


def idle_scopes(graph: g.Graph, plan: Plan) -> list[tuple[int, int]]:
    """Stage ranges (first, last) of the plan's recompute scopes that autograd would give no
    handle to (nothing they make is saved inside their top scope, nor in a nested one): the
    runtime never replays them, and keeping their stages plainly holds no more."""
    ps = PlanScopes(graph, plan)
    ps.classify_saves()
    first_stage = {st.first_op: st.index for st in plan.stages}
    last_stage = {st.last_op: st.index for st in plan.stages}
    return [(first_stage[sc.lo_op], last_stage[sc.hi_op]) for sc in ps.scopes
            if not any(s.handles for s in sc.subtree())]


def replay_counts(graph: g.Graph, plan: Plan) -> dict[int, int]:
    """How many times the runtime's replays run each forward op (absent: never) in one step
    under ``plan``: the recomputation the plan costs, early stops included."""
    ps = PlanScopes(graph, plan)
    ps.classify_saves()
    out: dict[int, int] = defaultdict(int)
    for sc in ps.replayed_scopes():
        for o in ps.replayed(sc):
            out[o] += 1
    return dict(out)


def _peak(ps: PlanScopes) -> Evaluation:
    """The sweep: every original value's lifetime, the tapes' copies, the replays' storages."""
    native = ps.classify_saves()
    trigger: dict[int, int] = {}  # scope -> the event whose first unpack replays it
    for sc in ps.scopes:
        unpacks = [ps.g.ops[o].unpack_event for s in sc.subtree() for _, o in s.handles
                   if ps.g.ops[o].unpack_event >= 0]
        if unpacks:
            trigger[sc.index] = min(unpacks)
    tape_death = {}  # top scope -> the event its tape dies at (its last handle's release)
    for sc in ps.scopes:
        if sc.parent is None:
            rel = [ps.release(o) for s in sc.subtree() for _, o in s.handles]
            tape_death[sc.index] = max(rel) if rel else ps.n_model - 1
    timeline = Timeline(ps.n_events, trigger, ps.scopes, ps.replayed)
    intervals = _originals(ps, timeline, native, trigger, tape_death)
    for sc in ps.replayed_scopes():
        intervals += replay_intervals(ps, sc, timeline)
    peak, forward_peak, at = timeline.sweep(intervals, ps.g)
    return Evaluation(peak, forward_peak, timeline.where(at, ps.g))


def _originals(ps: PlanScopes, timeline: Timeline, native: dict[int, int],
               trigger: dict[int, int], tape_death: dict[int, int]) -> list[Interval]:
    """The values of the step as it runs (not replays), held by the user's code, autograd's
    saves or a tape; and the copies the tapes make of written outside tensors."""
    tape_kept, record_copies = ps.tape_reads()
    m = timeline.moment_of_event
    intervals: list[Interval] = []  # (birth moment, death moment, bytes)

    def at(event: int | None) -> int:
        return NEVER if event is None else m[event]

    first_read = _first_reads(ps.g)
    for v in ps.g.values:
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
        held_by = ps.root_of_value(v.id) if ps.held(v.id) else None
        if held_by is not None:
            end = max(end, timeline.replay_end(held_by.index) if held_by.index in trigger
                      else m[tape_death[held_by.index]])
        intervals.append((birth, end, v.nbytes))
    for o, root, vid in record_copies:
        # One copy, held by every tape that read the value before the write.
        readers = [r for r, first in tape_kept.get(vid, ()) if first < o]
        intervals.append((m[o], max(m[tape_death[r.index]] for r in [root, *readers]),
                          ps.g.values[vid].nbytes))
    return intervals


def _first_reads(graph: g.Graph) -> dict[int, int]:
    """The first event reading each value."""
    out: dict[int, int] = {}
    for e, op in enumerate(graph.ops + graph.backward_ops):
        for vid in op.inputs:
            out.setdefault(vid, e)
    return out


def _earlier(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


__all__ = ["Evaluation", "evaluate", "idle_scopes", "replay_counts"]
