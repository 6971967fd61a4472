"""The evaluated step's moments (for ``memplan.core.evaluate``): each forward and backward
event, and after an event the replays it triggers, op by op; and the sweep that adds up the
bytes alive at every moment. Pure (no torch).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.floor import event_label
from memplan.core.scopes import PlanScopes, depth_then_index

I64 = npt.NDArray[np.int64]
NEVER = 1 << 62  # a death after every moment: alive after the step
Intervals = tuple[I64, I64, I64]  # (birth moment, death moment, bytes), one entry each


def joined(parts: list[Intervals]) -> Intervals:
    """Several sets of intervals as one."""
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]))


class Timeline:
    """Moments in step order: each event, and after an event the replays it triggers (a
    scope's parents first), each replayed op a moment (preceded by one for the copies of the
    outside tensors it writes). The i-th replayed op of a scope runs at ``base + 2 i + 1``,
    after the moment ``base + 2 i`` of its copies."""

    def __init__(self, ps: PlanScopes) -> None:
        order = sorted((ps.scopes[s] for s in ps.replayed_scopes()),
                       key=lambda sc: (int(ps.trigger[sc.index]), *depth_then_index(sc)))
        self.order = [sc.index for sc in order]  # replayed scopes, in the order they run
        self.triggered = ps.trigger >= 0
        self.length = np.zeros(len(ps.scopes), dtype=np.int64)
        for s in self.order:
            self.length[s] = len(ps.replayed(s))
        events = ps.trigger[self.order]
        extra = np.zeros(ps.n_events, dtype=np.int64)  # replay moments after each event
        np.add.at(extra, events, 2 * self.length[self.order])
        after = np.cumsum(extra)
        self.moment_of_event = np.arange(ps.n_events, dtype=np.int64) + after - extra
        self.n_moments = ps.n_events + int(after[-1]) if ps.n_events else 0
        self.base = np.full(len(ps.scopes), -1, dtype=np.int64)
        before = np.cumsum(2 * self.length[self.order]) - 2 * self.length[self.order]
        # Within an event, scopes run one after another from the moment after it.
        first = np.searchsorted(events, events)  # the first scope triggered by the same event
        self.base[self.order] = (self.moment_of_event[events] + 1 + before - before[first])
        self.ps = ps  # (for ``where``)

    def replay_end(self, scope: int) -> int:
        """The moment ``scope``'s replay ends (its last op; the one before it if empty)."""
        return int(self.base[scope] + 2 * self.length[scope] - 1)

    def replay_ends(self) -> I64:
        """``replay_end`` of every scope (meaningless for those never replayed)."""
        return self.base + 2 * self.length - 1

    def live(self, intervals: Intervals) -> I64:
        """The bytes alive at every moment."""
        birth, death, nbytes = intervals
        ok = death >= birth
        delta = np.zeros(self.n_moments + 1, dtype=np.int64)
        np.add.at(delta, birth[ok], nbytes[ok])
        np.add.at(delta, np.minimum(death[ok], self.n_moments - 1) + 1, -nbytes[ok])
        out: I64 = np.cumsum(delta[:-1])
        return out

    def sweep(self, live: I64, graph: g.Graph) -> tuple[int, int, int]:
        """(peak bytes, the forward's peak bytes, the moment of the peak) of ``live``."""
        at = int(np.argmax(live))
        fwd_end = int(self.moment_of_event[len(graph.ops) - 1]) + 1 if graph.ops else 0
        fwd_peak = int(live[:fwd_end].max()) if fwd_end else 0
        return int(live[at]), fwd_peak, at

    def replay_headroom(self, live: I64, peak_bytes: int) -> I64:
        """Per op (of ``ps.n``), the least the step stays below ``peak_bytes`` while a replay
        runs it: from the moment of its copies to that of the next op's (what an op's output
        and the values it frees span); for a region's ops after its replay stops, at the stop
        (a unit, ``runtime.units``, may run on there). ``peak_bytes`` where nothing replays.
        What a replay may keep beyond the op tape's without raising the step's peak."""
        ps, order = self.ps, np.array(self.order, dtype=np.int64)
        room = np.full(ps.n, peak_bytes, dtype=np.int64)
        if not len(order):
            return room
        length = self.length[order]
        # The stop: the replay's last moment, or the event that triggered an empty one.
        end = np.where(length > 0, self.replay_ends()[order],
                       self.moment_of_event[ps.trigger[order]])
        ops = np.concatenate([ps.replayed(int(s)) for s in order])
        m = np.repeat(self.base[order], length) + 2 * _spans(np.zeros_like(length), length)
        stop = np.repeat(end, length)
        worst = np.maximum(np.maximum(live[m], live[m + 1]), live[np.minimum(m + 2, stop)])
        np.minimum.at(room, ops, peak_bytes - worst)
        after = np.where(length > 0, ps.replay_last[order] + 1, ps.lo[order])
        count = np.maximum(ps.hi[order] + 1 - after, 0)
        np.minimum.at(room, _spans(after, count), np.repeat(peak_bytes - live[end], count))
        return room

    def where(self, moment: int, graph: g.Graph) -> str:
        """What runs at ``moment``, for people."""
        e = int(np.searchsorted(self.moment_of_event, moment, side="right")) - 1
        if self.moment_of_event[e] == moment:
            return event_label(graph, e)
        ran = [s for s in self.order if self.length[s]]  # (an empty replay has no moment)
        s = ran[int(np.searchsorted(self.base[ran], moment, side="right")) - 1]
        i, pre = divmod(moment - int(self.base[s]), 2)
        sc = self.ps.scopes[s]
        op = int(self.ps.replayed(s)[i])
        return (f"replay of ops {sc.lo_op}..{sc.hi_op}, " +
                (f"op {op}" if pre else f"before op {op}"))


def _spans(lo: I64, count: I64) -> I64:
    """``lo[k], lo[k] + 1, .., lo[k] + count[k] - 1`` for every k, in order."""
    first = np.cumsum(count) - count
    out: I64 = np.arange(int(count.sum()), dtype=np.int64) + np.repeat(lo - first, count)
    return out
