"""Liveness in the plain run: which forward values are live across each op boundary, and the
candidate cut points (stage boundaries) a plan may choose from: the paper's candidate set C in
Alg. 3, with the bytes a checkpoint there must keep. Pure Python over a Graph's ops."""

from __future__ import annotations

from memplan.core import graph as g


def live_across(
    values: tuple[g.Value, ...], ops: tuple[g.Op, ...], output_ids: tuple[int, ...]
) -> list[list[int]]:
    """For each boundary after forward op i: activation values made at or before i and read
    (or written) by a later forward op, or returned by the forward."""
    n = len(ops)
    last_use: dict[int, int] = {}
    for op in ops:
        for vid in op.inputs + op.mutated:
            last_use[vid] = op.index
    for vid in output_ids:
        last_use[vid] = n
    starts: list[list[int]] = [[] for _ in range(n)]
    for v in values:
        if v.kind == g.ACTIVATION and v.producer >= 0 and last_use.get(v.id, -1) > v.producer:
            starts[v.producer].append(v.id)
    out: list[list[int]] = []
    live: dict[int, None] = {}
    for i in range(n):
        for vid in starts[i]:
            live[vid] = None
        for vid in [v for v in live if last_use[v] <= i]:
            del live[vid]
        out.append(sorted(live))
    return out


def cut_points(
    values: tuple[g.Value, ...],
    ops: tuple[g.Op, ...],
    calls: tuple[g.ModuleCall, ...],
    output_ids: tuple[int, ...],
) -> tuple[g.CutPoint, ...]:
    """Candidate stage boundaries (the paper's candidate set C in Alg. 3).

    The end of a non-leaf module call is a candidate when the call consumes everything that was
    live at its start (a residual block, an LSTM step, a decoder layer), or when no boundary
    inside the call has fewer live bytes (it narrows to its output, with long-lived values such
    as attention masks passing through). The end of the forward is always one.
    """
    if not ops:
        return ()
    live = live_across(values, ops, output_ids)
    live_bytes = [sum(values[v].nbytes for v in ids) for ids in live]
    chosen: dict[int, g.ModuleCall] = {}
    for call in calls:
        if call.end <= call.start:
            continue
        after = call.end - 1
        before = set(live[call.start - 1]) if call.start > 0 else set()
        closes = not before.intersection(live[after])
        interior = live_bytes[call.start : after]
        if not closes and interior and live_bytes[after] > min(interior):
            continue
        best = chosen.get(after)
        if best is None or call.depth > best.depth:
            chosen[after] = call
    last = len(ops) - 1
    result = [
        g.CutPoint(after, tuple(live[after]), live_bytes[after], call.path, call.depth)
        for after, call in sorted(chosen.items())
        if after != last
    ]
    result.append(g.CutPoint(last, tuple(live[last]), live_bytes[last], "<end>", 0))
    return tuple(result)
