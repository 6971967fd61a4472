"""Which module calls a recompute region replays by calling the module again (units).

Re-running a call costs no per-op Python (the op tape's dispatch mode costs more than a small
op), but it frees values where the model's Python frees them, not right after their last use
as the op tape does, and it holds its arguments to its end. The plan's memory model is the op
tape's, so a region replays a call as a unit only where that does not raise the region's
replay above the op tape's peak: the bytes its replay keeps alive are computed for both from
one forward on fake tensors (each value's birth, last read and death, in op counts), and
calls are given back to the tape, outermost first where the excess is, until it fits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MAX_ROUNDS = 64  # per region: then only calls that hold nothing past last use


@dataclass(frozen=True)
class Call:
    """One module call of the fake forward."""

    path: str
    number: int  # 1-based, among the calls of that module, in the order they start
    first_op: int
    end_op: int  # exclusive
    safe: bool  # writes only tensors it made (and BatchNorm running statistics)


@dataclass
class Values:
    """Per value (storage) of the fake forward, in the order they were made: the op that
    made it, the last op that read it, the op count when it was freed (-1: alive when the
    forward returned, i.e. saved for backward or an output) and its bytes."""

    made: list[int]
    read: list[int]
    freed: list[int]
    nbytes: list[int]


def choose(regions: list[tuple[int, int]], calls: list[Call], values: Values
           ) -> dict[str, frozenset[int]]:
    """Units (module path -> call numbers) for each region ``(first_op, last_op)``: the
    outermost safe calls inside it, as long as its replay peak stays the op tape's."""
    chosen: dict[str, set[int]] = {}
    ordered = sorted((c for c in calls if c.safe and c.first_op < c.end_op),
                     key=lambda c: (c.first_op, -c.end_op))
    starts = [c.first_op for c in ordered]
    for first, last in regions:
        lo, hi = bisect.bisect_left(starts, first), bisect.bisect_left(starts, last + 1)
        inside = [c for c in ordered[lo:hi] if c.end_op <= last + 1]
        for c in _fit(first, last, inside, values):
            chosen.setdefault(c.path, set()).add(c.number)
    return {path: frozenset(numbers) for path, numbers in sorted(chosen.items())}


def _outermost(calls: list[Call], allowed: set[int]) -> list[Call]:
    out: list[Call] = []
    end = -1
    for i, c in enumerate(calls):  # sorted by (first_op, -end_op): parents first
        if i in allowed and c.first_op >= end:
            out.append(c)
            end = c.end_op
    return out


def _fit(first: int, last: int, calls: list[Call], values: Values) -> list[Call]:
    ref, _ = _peak(first, last, [], values)
    allowed = set(range(len(calls)))
    for _ in range(MAX_ROUNDS):
        units = _outermost(calls, allowed)
        peak, at = _peak(first, last, units, values)
        if peak <= ref:
            return units
        culprit = next((i for i, c in enumerate(calls) if i in allowed
                        and c.first_op <= at < c.end_op and c in units), None)
        if culprit is None:
            break
        allowed.discard(culprit)
    return []


def _peak(first: int, last: int, units: list[Call], values: Values) -> tuple[int, int]:
    """The most bytes the replay of ops first..last keeps alive at once, and the op where:
    values the forward keeps (saved for backward) to the end; the others to their last read
    (the op tape), or, made or last read inside a unit, to where Python frees them within
    the call or to its end."""
    end_of = [u.end_op for u in units]
    start_of = [u.first_op for u in units]
    delta = [0] * (last - first + 2)
    lo = bisect.bisect_left(values.made, first)
    hi = bisect.bisect_right(values.made, last)
    for v in range(lo, hi):
        made, freed, nbytes = values.made[v], values.freed[v], values.nbytes[v]
        read = max(values.read[v], made)
        if freed < 0:
            end = last + 1
        else:
            end = min(read + 1, last + 1)
            k = bisect.bisect_right(start_of, read) - 1
            if k >= 0 and read < end_of[k]:  # last read inside unit k
                unit_end = end_of[k]
                if made >= start_of[k]:  # made in it too: Python frees it, by the call's end
                    end = max(end, min(freed, unit_end))
                else:  # an argument: held to the call's end
                    end = max(end, unit_end)
        delta[made - first] += nbytes
        delta[min(end, last + 1) - first] -= nbytes
    peak = alive = 0
    at = first
    for i, d in enumerate(delta[:-1]):
        alive += d
        if alive > peak:
            peak, at = alive, first + i
    return peak, at
