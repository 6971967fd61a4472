"""The storages a scope's replay makes in backward, as (birth, death, bytes) in the moments of
``memplan.core.timeline`` (for ``memplan.core.evaluate``, whose docstring states the
semantics): each replayed op's outputs, and the copies of outside tensors it writes or reads
at a version changed since. Pure (no torch).
"""

from __future__ import annotations

from memplan.core import graph as g
from memplan.core.scopes import PlanScopes, Scope
from memplan.core.timeline import Interval, Timeline


def replay_intervals(ps: PlanScopes, sc: Scope, tl: Timeline) -> list[Interval]:
    """The storages scope ``sc``'s replay makes (and the copies it makes of written
    outside tensors), as (birth, death, bytes) in moments."""
    ops = ps.replayed(sc)
    values = ps.g.values
    root = sc.root
    last_read: dict[int, int] = {}  # value -> index in ops of its last replayed reader
    for i, o in enumerate(ops):
        for vid in ps.g.ops[o].inputs:
            last_read[vid] = i
    handle_release: dict[int, int] = {}
    for vid, o in sc.handles:
        handle_release[vid] = max(handle_release.get(vid, -1), ps.release(o))
    stash_until = stash_holds(ps, sc, tl)
    out: list[Interval] = []
    in_replay = set(ops)
    for i, o in enumerate(ops):
        main, pre = tl.replay_moments(sc.index, i)
        nxt = tl.replay_moments(sc.index, i + 1) if i + 1 < len(ops) else None
        written = ps.written(o)
        for vid in written:
            if ps.root_of_value(vid) is not root:
                span = (pre, nxt[1] if nxt else main)
                if values[vid].kind not in (g.BUFFER, g.PARAMETER):
                    span = (pre, max(span[1], _copy_end(ps, vid, i, ops, in_replay, tl,
                                                        sc.index)))
                out.append((*span, values[vid].nbytes))
        for vid in ps.g.ops[o].inputs:
            if vid not in written and ps.root_of_value(vid) is not root \
                    and values[vid].kind not in (g.PARAMETER, g.BUFFER) \
                    and ps.last_write().get(vid, -1) > o:
                # Read at a version changed since: replay reads a copy of the value it
                # had (``unit_replay.ext_value``), which lives while what it made from it does.
                out.append((pre, max(nxt[1] if nxt else main,
                                     _copy_end(ps, vid, i, ops, in_replay, tl, sc.index)),
                            values[vid].nbytes))
        for vid in ps.g.ops[o].outputs:
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


def _copy_end(ps: PlanScopes, vid: int, i: int, ops: list[int], in_replay: set[int],
              tl: Timeline, scope: int) -> int:
    """Until when a replay holds its copy of outside value ``vid`` made for its ``i``-th
    op: the copy stands in for the value in the replay (views of it, in-place results),
    so it lives until the replay's last reader of the value and the release of the saves
    of it by replayed ops (autograd saves the view the tape made, a handle)."""
    end = -1
    for j in range(len(ops) - 1, i, -1):
        if vid in ps.g.ops[ops[j]].inputs:
            end = (tl.replay_moments(scope, j + 1)[1] if j + 1 < len(ops)
                   else tl.replay_moments(scope, j)[0])
            break
    releases = [ps.release(o) for o in ps.savers.get(vid, ()) if o in in_replay]
    if releases:
        end = max(end, tl.moment_of_event[max(releases)])
    return end


def stash_holds(ps: PlanScopes, sc: Scope, tl: Timeline) -> dict[int, int]:
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
                until = tl.moment_of_event[max(ps.release(o) for s in d.subtree()
                                               for _, o in s.handles)]
            for o in range(d.lo_op, d.hi_op + 1):
                for vid in ps.g.ops[o].inputs:
                    p = ps.g.values[vid].producer
                    if ps.g.values[vid].kind == g.ACTIVATION and sc.lo_op <= p < child.lo_op:
                        out[vid] = max(out.get(vid, -1), until)
    return out
