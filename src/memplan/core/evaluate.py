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
hold the rest. All of it is array arithmetic over ``eval_arrays`` (what the Graph holds,
derived once per Graph): the walk over every op of a long graph is what a user of
``memplan.plan`` would otherwise wait for, several times per plan (``fit``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.eval_arrays import KIND
from memplan.core.graph_arrays import NO_DEATH
from memplan.core.plan import Plan
from memplan.core.replay_intervals import replay_intervals
from memplan.core.scopes import PlanScopes
from memplan.core.timeline import NEVER, Intervals, Timeline, joined
from memplan.errors import PlanMismatch

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Evaluation:
    """The evaluated step: its peak, the forward's peak, where the peak is, and per forward
    op the least the step stays below its peak while a replay runs the op
    (``Timeline.replay_headroom``)."""

    peak_bytes: int
    forward_peak_bytes: int
    peak_at: str
    replay_headroom: I64 = field(compare=False, repr=False,
                                 default_factory=lambda: np.zeros(0, dtype=np.int64))


def evaluate(graph: g.Graph, plan: Plan) -> Evaluation:
    """The peak bytes of ``graph``'s step run under ``plan`` by the runtime (see the module
    docstring), exact to the byte where the runtime behaves as modelled."""
    return evaluate_scopes(plan_scopes(graph, plan))


def with_evaluation(plan: Plan, ev: Evaluation) -> Plan:
    """``plan`` with its evaluated peak (``ev``, of this plan) as ``peak_bytes`` and, per
    recomputed stage, the least replay headroom over its ops (``Stage.replay_headroom_bytes``,
    which the runtime's units may use)."""
    room = ev.replay_headroom
    stages = tuple(replace(st, replay_headroom_bytes=int(room[st.first_op: st.last_op + 1].min()))
                   if st.mode == "recompute" and st.first_op < len(room) else st
                   for st in plan.stages)
    return replace(plan, peak_bytes=ev.peak_bytes, stages=stages)


def plan_scopes(graph: g.Graph, plan: Plan) -> PlanScopes:
    """What ``plan`` makes of ``graph``'s forward: what ``evaluate_scopes`` and
    ``idle_of`` read (make it once for both)."""
    if plan.graph_fingerprint != graph.fingerprint:
        raise PlanMismatch(f"the plan was made for graph {plan.graph_fingerprint}, not for "
                           f"{graph.fingerprint}: evaluate it on the graph it was made from.")
    return PlanScopes(graph, plan)


def idle_scopes(graph: g.Graph, plan: Plan) -> list[tuple[int, int]]:
    """Stage ranges (first, last) of the plan's recompute scopes that autograd would give no
    handle to (nothing they make is saved inside their top scope, nor in a nested one): the
    runtime never replays them, and keeping their stages plainly holds no more."""
    return idle_of(PlanScopes(graph, plan), plan)


def idle_of(ps: PlanScopes, plan: Plan) -> list[tuple[int, int]]:
    """``idle_scopes`` of the plan ``ps`` was made from."""
    first_stage = {st.first_op: st.index for st in plan.stages}
    last_stage = {st.last_op: st.index for st in plan.stages}
    return [(first_stage[sc.lo_op], last_stage[sc.hi_op]) for sc in ps.scopes
            if not ps.kept[sc.index]]


def replay_counts(graph: g.Graph, plan: Plan) -> dict[int, int]:
    """How many times the runtime's replays run each forward op (absent: never) in one step
    under ``plan``: the recomputation the plan costs, early stops included."""
    ps = PlanScopes(graph, plan)
    out: dict[int, int] = defaultdict(int)
    for sc in ps.replayed_scopes():
        for o in ps.replayed(sc):
            out[int(o)] += 1
    return dict(out)


def evaluate_scopes(ps: PlanScopes) -> Evaluation:
    """The sweep: every original value's lifetime, the tapes' copies, the replays' storages."""
    timeline = Timeline(ps)
    intervals = joined([_originals(ps, timeline), _tape_copies(ps, timeline),
                        replay_intervals(ps, timeline)])
    live = timeline.live(intervals)
    peak, forward_peak, at = timeline.sweep(live, ps.g)
    return Evaluation(peak, forward_peak, timeline.where(at, ps.g),
                      timeline.replay_headroom(live, peak))


def _originals(ps: PlanScopes, timeline: Timeline) -> Intervals:
    """The values of the step as it runs (not replays), held by the user's code, autograd's
    saves or a tape."""
    a = ps.a
    m = timeline.moment_of_event
    tape_end = m[ps.tape_death]  # per scope (read for top scopes only)
    (kept_vid, kept_root, _), _copies = ps.tape_reads()
    kept_end = np.full(len(a.kind), -1, dtype=np.int64)  # the last tape keeping the value
    np.maximum.at(kept_end, kept_vid, tape_end[kept_root])
    birth = np.where(a.birth >= 0, m[a.birth], 0)
    # A tensor from outside the step counts from the first op that reads it (memplan's
    # tracker sees it then); a scalar autograd wrapped that no op reads, never.
    outside = (a.kind == KIND[g.EXTERNAL]) & (a.birth < 0)
    birth = np.where(outside, m[a.first_seen], birth)
    seen = ~outside | (a.first_seen >= 0)
    plain = (a.kind != KIND[g.ACTIVATION]) | (a.producer < 0)  # a tape may keep it longer
    # An activation dies when the user's code lets it go, or later when autograd's saves of it
    # are released, a tape keeps it, or a drop-cheap tape holds it until its scope replays.
    end = _moment(m, np.where(plain, a.death, a.death_unsaved))
    native = np.where(plain, -1, ps.native)
    end = np.where(native >= 0, np.maximum(end, m[native]), end)
    end = np.maximum(end, kept_end)
    held = np.flatnonzero(ps.held & ~plain)
    root = ps.root_of_value[held]
    held_end = np.where(timeline.triggered[root], timeline.replay_ends()[root], tape_end[root])
    end[held] = np.maximum(end[held], held_end)
    return birth[seen], end[seen], a.nbytes[seen]


def _tape_copies(ps: PlanScopes, timeline: Timeline) -> Intervals:
    """The copies the tapes make of written outside tensors: one per write, held by the tape
    of the writing op and by every tape that read the value before the write."""
    m = timeline.moment_of_event
    tape_end = m[ps.tape_death]
    (kept_vid, kept_root, kept_op), (op, root, vid) = ps.tape_reads()
    readers: dict[int, list[tuple[int, int]]] = defaultdict(list)  # value -> (root, first op)
    copied = np.isin(kept_vid, vid)
    first: dict[tuple[int, int], int] = {}
    for v, r, o in zip(kept_vid[copied].tolist(), kept_root[copied].tolist(),
                       kept_op[copied].tolist(), strict=True):
        first[v, r] = min(first.get((v, r), o), o)
    for (v, r), o in first.items():
        readers[v].append((r, o))
    ends = [max([int(tape_end[r])] + [int(tape_end[q]) for q, f in readers[v] if f < o])
            for o, r, v in zip(op.tolist(), root.tolist(), vid.tolist(), strict=True)]
    return m[op], np.array(ends, dtype=np.int64), ps.a.nbytes[vid]


def _moment(m: I64, event: I64) -> I64:
    """The moment of each event, NEVER for NO_DEATH (alive after the step)."""
    never = event == NO_DEATH
    return np.where(never, NEVER, m[np.where(never, 0, event)])


__all__ = ["Evaluation", "evaluate", "evaluate_scopes", "idle_of", "idle_scopes",
           "plan_scopes", "replay_counts", "with_evaluation"]
