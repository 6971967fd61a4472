"""Which module calls a recompute region replays by calling the module again (units).

Re-running a call costs no per-op Python (the op tape's dispatch mode costs more than a small
op), but it frees values where the model's Python frees them, not right after their last use
as the op tape does, and the replay keeps its arguments until it has run it, read by its ops
or not (x-transformers hands ``pos`` to every attention block, which never reads it). The
plan's memory model is the op tape's, so a region replays a call as a unit only where that
keeps its replay at or below the op tape's at every op (not only at its peak: the step may
peak while another replay is alive), plus what the plan's evaluated step leaves below its
peak there (``Stage.replay_headroom_bytes``): the bytes its replay keeps alive are computed
for both from one forward on fake tensors (each value's birth, reads and death, in op
counts), and calls are given back to the tape, outermost first where the excess is, until it
fits. Nor is a call a unit where the region's tape would keep an argument the op tape does
not: a tensor from before the region that no op of the region reads (``pos`` again), which
the tape would hold into backward, where the plan's model lets it die with the forward.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

MAX_ROUNDS = 64  # per region: then only calls that hold nothing past last use


@dataclass(frozen=True)
class Call:
    """One module call of the fake forward."""

    path: str
    number: int  # 1-based, among the calls of that module, in the order they start
    first_op: int
    end_op: int  # exclusive
    safe: bool  # writes only tensors it made (and BatchNorm running statistics)
    args: tuple[int, ...] = ()  # the values (of ``Values``) it is given as tensor arguments


@dataclass
class Values:
    """Per value (storage) of the fake forward, in the order they were made: the op that
    made it, the op count when it was freed (-1: alive when the forward returned, i.e. saved
    for backward or an output), its bytes and the ops that read it, in order."""

    made: list[int]
    freed: list[int]
    nbytes: list[int]
    reads: list[list[int]]
    # What autograd saved, in order: (op count then, value or -1 for a tensor the forward
    # did not make, whether a module call began or ended since the last op). An op's inputs
    # are saved before it runs, its outputs after (``_within``).
    saves: list[tuple[int, int, bool]] = field(default_factory=list)


def choose(regions: list[tuple[int, int]], calls: list[Call], values: Values,
           headroom: list[int] | None = None) -> dict[str, frozenset[int]]:
    """Units (module path -> call numbers) for each region ``(first_op, last_op)``: the
    outermost safe calls inside it, as long as its replay keeps no more than the op tape's
    plus ``headroom`` (per op, ``Stage.replay_headroom_bytes``; none: 0) at every op."""
    chosen: dict[str, set[int]] = {}
    ordered = sorted((c for c in calls if c.safe and c.first_op < c.end_op),
                     key=lambda c: (c.first_op, -c.end_op))
    starts = [c.first_op for c in ordered]
    for first, last in regions:
        lo, hi = bisect.bisect_left(starts, first), bisect.bisect_left(starts, last + 1)
        inside = [c for c in ordered[lo:hi] if c.end_op <= last + 1
                  and not _keeps_unread(c, first, last, values)]
        room = headroom[first: last + 1] if headroom else [0] * (last + 1 - first)
        for c in _fit(first, last, inside, values, room):
            chosen.setdefault(c.path, set()).add(c.number)
    return {path: frozenset(numbers) for path, numbers in sorted(chosen.items())}


def _keeps_unread(call: Call, first: int, last: int, values: Values) -> bool:
    """Whether the call, a unit of region first..last, is given a value made before the
    region that no op of the region reads: the unit's tape would keep it (replay passes it
    again) where the op tape, and the plan's model (``core.evaluate``), keep only what the
    region's ops read."""
    for v in call.args:
        if values.made[v] < first:
            reads = values.reads[v]
            k = bisect.bisect_left(reads, first)
            if k == len(reads) or reads[k] > last:
                return True
    return False


def _outermost(calls: list[Call], allowed: set[int]) -> list[Call]:
    out: list[Call] = []
    end = -1
    for i, c in enumerate(calls):  # sorted by (first_op, -end_op): parents first
        if i in allowed and c.first_op >= end:
            out.append(c)
            end = c.end_op
    return out


def _fit(first: int, last: int, calls: list[Call], values: Values, room: list[int]
         ) -> list[Call]:
    """Units whose replay keeps no more alive than the op tape's plus ``room`` (per op of the
    region) at any op, not only at its peak: the step peaks where another replay's values are
    alive too, which may be anywhere in this one (HF MegatronBert: an encoder layer's unit
    held the attention mask it is given past the tape's last read of it, 24,448 B over the
    plan where the next layer replayed). ``room`` is the plan's evaluated step below its peak
    there, so the step's peak stays the plan's."""
    saved = _saved_in(first, last, values)
    tape = _profile(first, _tape_end(first, last, values) - 1, [], values, saved)
    allowed = set(range(len(calls)))
    for _ in range(MAX_ROUNDS):
        units = _outermost(calls, allowed)
        end, run = _replay_end(first, last, units, values)
        at = _over(_profile(first, end - 1, run, values, saved), tape, first, room)
        if at < 0:
            return units
        culprit = _culprit(calls, allowed, units, at, values)
        if culprit is None:
            break
        allowed.discard(culprit)
    return []


def _culprit(calls: list[Call], allowed: set[int], units: list[Call], at: int,
             values: Values) -> int | None:
    """The unit to give back to the tape for a replay peak at op ``at``: the one running
    there, else one holding an argument there, made by an earlier op (``_held_args``)."""
    running = next((i for i, c in enumerate(calls) if i in allowed and c in units
                    and c.first_op <= at < c.end_op), None)
    if running is not None:
        return running
    return next((i for i, c in enumerate(calls) if i in allowed and c in units
                 and any(values.made[v] <= at < c.first_op for v in c.args)), None)


def _within(count: int, hooked: bool, lo: int, hi: int) -> bool:
    """Whether a save at op count ``count`` was made inside a call (or region) of ops
    lo..hi-1: at ``lo``, an input of its first op (after the call began); at ``hi``, an output
    of its last op (before the call ended)."""
    return lo < count < hi or (count == lo and hooked) or (count == hi and not hooked)


def _tape_end(first: int, last: int, values: Values) -> int:
    """Where the op tape's replay of ops first..last stops (``replay._entries_to_run``): after
    the last op that made a value an op of the region saves."""
    end = first
    for count, v, hooked in values.saves:
        if v >= 0 and _within(count, hooked, first, last + 1) and first <= values.made[v] <= last:
            end = max(end, values.made[v] + 1)
    return end


def _replay_end(first: int, last: int, units: list[Call], values: Values
                ) -> tuple[int, list[Call]]:
    """Where the replay of ops first..last with these units stops, and the units it runs: up
    to the last entry that makes what the region saves; that entry, a unit none of whose
    outputs is saved after it, cut at its last save (``replay._entries_to_run``)."""
    starts = [u.first_op for u in units]

    def unit_of(count: int, hooked: bool) -> int:
        k = bisect.bisect_right(starts, count) - 1
        for j in (k, k - 1):
            if j >= 0 and _within(count, hooked, units[j].first_op, units[j].end_op):
                return j
        return -1

    end = first
    saving = -1  # the last unit that saves something
    last_save = [-1] * len(units)
    outputs_needed = [False] * len(units)
    for count, v, hooked in values.saves:
        if not _within(count, hooked, first, last + 1):
            continue
        k = unit_of(count, hooked)
        if k >= 0:
            saving = max(saving, k)
            last_save[k] = max(last_save[k], count)
        if v < 0 or not first <= values.made[v] <= last:
            continue  # a parameter, or from before the region: saved as it is
        maker = unit_of(values.made[v], True)
        if maker < 0:
            end = max(end, values.made[v] + 1)
        elif maker != k:
            outputs_needed[maker] = True
            end = max(end, units[maker].end_op)
    if saving >= 0 and units[saving].end_op > end:
        end = units[saving].end_op if outputs_needed[saving] else max(end, last_save[saving])
    run = [u if u.end_op <= end else replace(u, end_op=end) for u in units if u.first_op < end]
    return min(end, last + 1), run


def _held_args(units: list[Call]) -> dict[int, int]:
    """Per value a unit is given, the end of the last such unit: a replay keeps a unit's
    arguments until it has run it (``replay._replay``), read by its ops or not."""
    held: dict[int, int] = {}
    for u in units:
        for v in u.args:
            held[v] = max(held.get(v, 0), u.end_op)
    return held


def _over(alive: list[int], tape: list[int], first: int, room: list[int]) -> int:
    """The first op where a replay keeps more alive than the op tape at the same op (after
    the tape's replay stopped: more than it keeps then) plus that op's ``room``; -1:
    nowhere."""
    kept = tape[-1] if tape else 0
    for i, n in enumerate(alive):
        if n > (tape[i] if i < len(tape) else kept) + room[i]:
            return first + i
    return -1


def _saved_in(first: int, last: int, values: Values) -> set[int]:
    """Values of the forward an op of ``first..last`` saves: what a replay of the region
    gives back (its handles), kept to the replay's end."""
    return {v for count, v, hooked in values.saves
            if v >= 0 and _within(count, hooked, first, last + 1)}


def _profile(first: int, last: int, units: list[Call], values: Values, saved: set[int]
             ) -> list[int]:
    """The bytes the replay of ops first..last keeps alive at each op: values the region
    saves (``saved``) to the end; the others to their last read by the replay (the op tape:
    a read after it, by an op outside the region, reads the forward's own value), or, made or
    last read inside a unit, to where Python frees them within the call or to its end."""
    end_of = [u.end_op for u in units]
    start_of = [u.first_op for u in units]
    held = _held_args(units)
    delta = [0] * (last - first + 2)
    lo = bisect.bisect_left(values.made, first)
    hi = bisect.bisect_right(values.made, last)
    for v in range(lo, hi):
        made, freed, nbytes = values.made[v], values.freed[v], values.nbytes[v]
        if v in saved:
            end = last + 1
        else:
            read = max(_last_read(values, v, last), made)
            end = read + 1
            k = bisect.bisect_right(start_of, read) - 1
            if k >= 0 and read < end_of[k]:  # last read inside unit k
                unit_end = end_of[k]
                if made >= start_of[k]:  # made in it too: Python frees it, by the call's end
                    end = max(end, unit_end if freed < 0 else min(freed, unit_end))
                else:  # an argument: held to the call's end
                    end = max(end, unit_end)
            end = max(end, held.get(v, end))
        delta[made - first] += nbytes
        delta[min(end, last + 1) - first] -= nbytes
    alive, out = 0, []
    for d in delta[:-1]:
        alive += d
        out.append(alive)
    return out


def _last_read(values: Values, v: int, last: int) -> int:
    """The last op up to ``last`` that reads value ``v`` (-1: none)."""
    reads = values.reads[v]
    k = bisect.bisect_right(reads, last)
    return reads[k - 1] if k else -1
