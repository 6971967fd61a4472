"""The storages the scopes' replays make in backward, as (birth, death, bytes) in the moments of
``memplan.core.timeline`` (for ``memplan.core.evaluate``, whose docstring states the
semantics): each replayed op's outputs, and the copies of outside tensors it writes or reads
at a version changed since. Every replayed op of every scope at once: one row per (scope,
position in its replay). Pure (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.eval_arrays import KIND
from memplan.core.scopes import PlanScopes
from memplan.core.timeline import Intervals, Timeline, joined

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ByKey:
    """The greatest value per key (sorted keys): a dict over arrays."""

    keys: I64
    most: I64

    def get(self, keys: I64) -> I64:
        """The value of each key, -1 where absent."""
        if not len(self.keys):
            return np.full(len(keys), -1, dtype=np.int64)
        i = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return np.where(self.keys[i] == keys, self.most[i], -1)


def by_key(keys: I64, values: I64) -> ByKey:
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    last = np.append(k[1:] != k[:-1], True) if len(k) else np.zeros(0, dtype=np.bool_)
    return ByKey(k[last], v[last])


@dataclass(frozen=True)
class Rows:
    """The replayed ops of every replayed scope: op, scope, position in the replay, length of
    the replay, and its moments."""

    op: I64
    scope: I64
    pos: I64
    length: I64
    pre: I64  # the moment of the copies made for the op
    main: I64  # the op's own moment
    step_end: I64  # the next op's copies' moment (this op's, if the last)
    out_end: I64  # the next op's moment (this op's, if the last)

    def read_end(self, k: I64, j: I64) -> I64:
        """Until when row ``k``'s replay holds what its ``j``-th op reads: after that op
        (its next op's copies, or its own moment if the last)."""
        base = self.pre[k] - 2 * self.pos[k]
        return np.where(j + 1 < self.length[k], base + 2 * (j + 1), base + 2 * j + 1)


def _rows(ps: PlanScopes, tl: Timeline) -> Rows:
    scopes = ps.replayed_scopes()
    ops = [ps.replayed(s) for s in scopes]
    lens = np.array([len(o) for o in ops], dtype=np.int64)
    op = np.concatenate(ops) if ops else np.zeros(0, dtype=np.int64)
    scope = np.repeat(np.array(scopes, dtype=np.int64), lens)
    length = np.repeat(lens, lens)
    pos = np.arange(len(op), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    pre = tl.base[scope] + 2 * pos
    last = pos + 1 == length
    return Rows(op, scope, pos, length, pre, pre + 1, np.where(last, pre + 1, pre + 2),
                np.where(last, pre + 1, pre + 3))


def replay_intervals(ps: PlanScopes, tl: Timeline) -> Intervals:
    """The storages every replay makes (and the copies it makes of written outside
    tensors), as (birth, death, bytes) in moments."""
    a = ps.a
    nv = len(a.kind)
    r = _rows(ps, tl)
    k_in, vid_in = a.inputs.rows(r.op)
    last_read = by_key(r.scope[k_in] * nv + vid_in, r.pos[k_in])  # its last replayed reader
    m = tl.moment_of_event
    release = by_key(ps.h_scope * nv + ps.h_vid, a.release[ps.h_op])  # own handles only
    stash = stash_holds(ps, tl)
    k, vid = a.outputs.rows(r.op)
    key = r.scope[k] * nv + vid
    end = r.out_end[k]
    j = last_read.get(key)
    end = np.where(j > r.pos[k], np.maximum(end, r.read_end(k, j)), end)
    rel = release.get(key)
    end = np.where(rel >= 0, np.maximum(end, m[rel]), end)
    end = np.maximum(end, stash.get(key))
    made = (r.main[k], end, a.nbytes[vid])
    return joined([made, _copies(ps, tl, r, last_read)])


def _copies(ps: PlanScopes, tl: Timeline, r: Rows, last_read: ByKey) -> Intervals:
    """Copies of outside tensors a replayed op writes (a parameter's or buffer's for the op
    only), or reads at a version a later op changed (``unit_replay.ext_value``: the value it
    had), each living while the replay uses it."""
    a = ps.a
    k_w, vid_w = a.written.rows(r.op)
    k_s, vid_s = a.stale.rows(r.op)
    kind = a.kind[vid_w]
    lasting = np.concatenate([(kind != KIND[g.BUFFER]) & (kind != KIND[g.PARAMETER]),
                              np.ones(len(k_s), dtype=np.bool_)])
    k, vid = np.concatenate([k_w, k_s]), np.concatenate([vid_w, vid_s])
    outside = ps.root_of_value[vid] != ps.root[r.scope[k]]
    k, vid, lasting = k[outside], vid[outside], lasting[outside]
    end = r.step_end[k]
    held = _copy_end(ps, tl, r, last_read, k[lasting], vid[lasting])
    end[lasting] = np.maximum(end[lasting], held)
    return r.pre[k], end, a.nbytes[vid]


def _copy_end(ps: PlanScopes, tl: Timeline, r: Rows, last_read: ByKey, k: I64, vid: I64
              ) -> I64:
    """Until when a replay holds its copy of outside value ``vid`` made for its row ``k``:
    the copy stands in for the value in the replay (views of it, in-place results), so it
    lives until the replay's last reader of the value and the release of the saves of it by
    replayed ops (autograd saves the view the tape made, a handle)."""
    a = ps.a
    j = last_read.get(r.scope[k] * len(a.kind) + vid)
    end = np.where(j > r.pos[k], r.read_end(k, j), -1)
    i, saver = a.savers.rows(vid)
    s = r.scope[k][i]
    replayed = (ps.lo[s] <= saver) & (saver <= ps.replay_last[s]) & ~(
        ps.drop_cheap[s] & a.expensive[saver])
    last = np.full(len(k), -1, dtype=np.int64)
    np.maximum.at(last, i[replayed], a.release[saver[replayed]])
    return np.where(last >= 0, np.maximum(end, tl.moment_of_event[last]), end)


def stash_holds(ps: PlanScopes, tl: Timeline) -> ByKey:
    """Values made in a replayed scope before a nested scope starts that the nested scope (or
    one nested in it) reads: it takes them from the replay. Per (scope, value): the moment
    until which the last of them keeps one (the end of its replay, or its release)."""
    keys, until = [], []
    nv = len(ps.a.kind)
    for s in ps.replayed_scopes():
        for child in ps.scopes[s].children:
            for d in child.subtree():
                if not ps.kept[d.index]:
                    continue  # nobody kept this scope: it was released in the forward
                held = (tl.replay_end(d.index) if tl.triggered[d.index]
                        else int(tl.moment_of_event[ps.sub_release[d.index]]))
                vid = ps.reads_from(d.index, int(ps.lo[s]), child.lo_op)
                keys.append(s * nv + vid)
                until.append(np.full(len(vid), held, dtype=np.int64))
    return by_key(*_cat2(keys, until))


def _cat2(a: list[I64], b: list[I64]) -> tuple[I64, I64]:
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate(a) if a else empty), (np.concatenate(b) if b else empty)
