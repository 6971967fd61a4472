"""The evaluated step's moments (for ``memplan.core.evaluate``): each forward and backward
event, and after an event the replays it triggers, op by op; and the sweep that adds up the
bytes alive at every moment. Pure (no torch).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from memplan.core import graph as g
from memplan.core.floor import event_label
from memplan.core.scopes import Scope, depth_then_index

NEVER = 1 << 62  # a death after every moment: alive after the step
Interval = tuple[int, int, int]  # (birth moment, death moment, bytes)


class Timeline:
    """Moments in step order: each event, and after an event the replays it triggers (a
    scope's parents first), each replayed op a moment (preceded by one for the copies of the
    outside tensors it writes)."""

    def __init__(self, n_events: int, trigger: dict[int, int], scopes: list[Scope],
                 replayed: Callable[[Scope], list[int]]) -> None:
        self.triggered = set(trigger)
        by_event: dict[int, list[Scope]] = defaultdict(list)
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
            for sc in sorted(by_event.get(e, ()), key=depth_then_index):
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

    def sweep(self, intervals: list[Interval], graph: g.Graph) -> tuple[int, int, int]:
        """(peak bytes, the forward's peak bytes, the moment of the peak)."""
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
        return int(live[at]), fwd_peak, at

    def where(self, moment: int, graph: g.Graph) -> str:
        """What runs at ``moment``, for people."""
        label = self.labels[moment]
        if label.startswith("event "):
            return event_label(graph, int(label.split()[1]))
        return label
