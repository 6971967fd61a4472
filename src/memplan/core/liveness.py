"""Liveness in the plain run: which forward values are live across each op boundary, and the
candidate cut points (stage boundaries) a plan may choose from: the paper's candidate set C in
Alg. 3, with the bytes a checkpoint there must keep. Pure Python over a Graph's ops."""

from __future__ import annotations

import bisect

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
    as attention masks passing through). The end of the forward is always one. Where those
    leave a coarse gap (``fine_cuts``: a flat nn.Sequential, functional code), ends of leaf
    module calls and op boundaries are candidates too.
    """
    if not ops:
        return ()
    live = live_across(values, ops, output_ids)
    live_bytes = [sum(values[v].nbytes for v in ids) for ids in live]
    chosen: dict[int, g.ModuleCall] = {}
    for call in calls:
        if call.leaf or call.end <= call.start:
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
    fine = fine_cuts(values, ops, calls, live, live_bytes, [c.after for c in result])
    return tuple(sorted(result + fine, key=lambda c: c.after))


COARSE = 4  # a gap holding more than 1/COARSE of the forward's saved bytes gets fine cuts


def fine_cuts(values: tuple[g.Value, ...], ops: tuple[g.Op, ...],
              calls: tuple[g.ModuleCall, ...], live: list[list[int]], live_bytes: list[int],
              afters: list[int]) -> list[g.CutPoint]:
    """Leaf-call ends and op boundaries inside the coarse gaps between the call cuts
    ``afters`` (a gap is coarse when its ops save more than 1/COARSE of what the forward
    saves: the chain cannot split it otherwise). Elsewhere they could not lower a peak the
    layers' own boundaries do not, and would only lengthen the chain.

    An op boundary (after op i of functional code, outside any leaf call) is kept where its
    live bytes are a local minimum among the gap's op boundaries, and only after an op that
    makes a new storage and saves none of its own outputs (the runtime advances the stage as
    op i returns, before autograd saves its outputs)."""
    saved_in = [sum(values[v].nbytes for v in op.saved) for op in ops]
    total = sum(saved_in)
    # (the model itself, without submodules, is no leaf here: its code is the functional code)
    leaves = sorted((c for c in calls if c.leaf and c.depth > 0 and c.end > c.start),
                    key=lambda c: c.start)
    in_leaf = [False] * len(ops)
    for c in leaves:
        in_leaf[c.start : c.end] = [True] * (c.end - c.start)
    out: list[g.CutPoint] = []
    lo = 0
    taken = set(afters)
    for hi in afters:
        if total and sum(saved_in[lo : hi + 1]) * COARSE > total:
            found = _leaf_ends(leaves, live, live_bytes, lo, hi, taken)
            found += _op_boundaries(ops, in_leaf, live, live_bytes, lo, hi, taken)
            out += _spread(sorted(found, key=lambda c: c.after), saved_in, lo)
        lo = hi + 1
    return out


MAX_FINE = 32  # fine cuts per gap, at most: a longer chain costs planning time, little peak


def _spread(found: list[g.CutPoint], saved_in: list[int], lo: int) -> list[g.CutPoint]:
    """At most MAX_FINE of a gap's fine cuts: the candidates split into MAX_FINE runs of
    about equal saved bytes, and the narrowest cut (fewest live bytes; the last on ties) of
    each run."""
    if len(found) <= MAX_FINE:
        return found
    weight = [0]
    prev = lo
    for c in found:
        weight.append(weight[-1] + sum(saved_in[prev : c.after + 1]))
        prev = c.after + 1
    total = max(weight[-1], 1)
    runs: dict[int, g.CutPoint] = {}
    for c, w in zip(found, weight[1:]):
        run = min(MAX_FINE - 1, (w - 1) * MAX_FINE // total) if w > 0 else 0
        best = runs.get(run)
        if best is None or c.live_bytes <= best.live_bytes:
            runs[run] = c
    return [runs[r] for r in sorted(runs)]


def _leaf_ends(leaves: list[g.ModuleCall], live: list[list[int]], live_bytes: list[int],
               lo: int, hi: int, taken: set[int]) -> list[g.CutPoint]:
    out = []
    for c in leaves:
        after = c.end - 1
        if lo <= c.start and after < hi and after not in taken:
            taken.add(after)
            out.append(g.CutPoint(after, tuple(live[after]), live_bytes[after], c.path,
                                  c.depth, g.LEAF))
    return out


def _op_boundaries(ops: tuple[g.Op, ...], in_leaf: list[bool], live: list[list[int]],
                   live_bytes: list[int], lo: int, hi: int, taken: set[int]
                   ) -> list[g.CutPoint]:
    spots = [i for i in range(lo, hi) if not in_leaf[i] and ops[i].outputs
             and not set(ops[i].outputs).intersection(ops[i].saved)]
    out = []
    for k, i in enumerate(spots):
        prev = live_bytes[spots[k - 1]] if k else live_bytes[i]
        nxt = live_bytes[spots[k + 1]] if k + 1 < len(spots) else live_bytes[i]
        if i not in taken and live_bytes[i] <= min(prev, nxt):
            taken.add(i)
            out.append(g.CutPoint(i, tuple(live[i]), live_bytes[i], ops[i].module, 0, g.OP))
    return out


def shared_values(
    values: tuple[g.Value, ...], ops: tuple[g.Op, ...], calls: tuple[g.ModuleCall, ...]
) -> frozenset[int]:
    """Activations made once and handed to many module calls: rotary cos/sin tables, a
    materialised attention mask, T5's position bias, DenseNet's features. A value is shared
    when ops inside at least two distinct module calls read it, counting for each reading op
    the outermost call around it that does not contain the value's producer, and at least two
    of those calls diverging from the producer's at the same depth. A residual stream (read
    inside one layer), a U-Net skip (read where the skips are joined) and a recurrent state
    (read by the next layer and by the next step) are not.

    Such values are resident from creation to their last use whatever the plan does (each
    layer reads them; the runtime keeps them as a tape's outside input), so the chain counts
    them like parameters and never lets them decide where a boundary may go.
    """
    chains = _call_chains(len(ops), tuple(c for c in calls if not c.leaf))
    found: dict[int, dict[int, set[int]]] = {}
    for op in ops:
        for vid in op.inputs:
            v = values[vid]
            if v.kind != g.ACTIVATION or v.producer < 0 or v.producer >= op.index:
                continue
            reader, maker = chains[op.index], chains[v.producer]
            k = 0
            while k < len(reader) and k < len(maker) and reader[k] == maker[k]:
                k += 1
            if k < len(reader):
                found.setdefault(vid, {}).setdefault(k, set()).add(reader[k])
    # Two reading calls at one depth below the producer's (layers of one model), not one at
    # each (an LSTM cell's h, read by the next layer of its step and by the next step).
    return frozenset(vid for vid, by_depth in found.items()
                     if any(len(outer) >= 2 for outer in by_depth.values()))


def skip_values(
    values: tuple[g.Value, ...], ops: tuple[g.Op, ...], calls: tuple[g.ModuleCall, ...]
) -> frozenset[int]:
    """Activations that pass over two or more whole module calls between where they are
    made and where they are last read: a U-Net's encoder outputs (read by the decoder, past
    the blocks in between). A layer's input (made by the layer before, read by this one)
    passes over none; a residual stream added around a block (``x = x + block(x)``) over one.

    Found in the call tree: the innermost call around both the producer and the last reader,
    and its direct child calls lying wholly between them."""
    outer = tuple(c for c in calls if not c.leaf and c.end > c.start)
    chains = _call_chains(len(ops), outer)
    children: dict[int, list[tuple[int, int]]] = {}
    for i, c in enumerate(outer):
        chain = chains[c.start]
        parent = chain[chain.index(i) - 1] if chain.index(i) > 0 else -1
        children.setdefault(parent, []).append((c.start, c.end))
    for kids in children.values():
        kids.sort()
    last_read = [-1] * len(values)
    for op in ops:
        for vid in op.inputs:
            last_read[vid] = op.index
    out = []
    for v in values:
        p, u = v.producer, last_read[v.id]
        if v.kind != g.ACTIVATION or p < 0 or u <= p + 1:
            continue
        a, b = chains[p], chains[u]
        k = 0
        while k < len(a) and k < len(b) and a[k] == b[k]:
            k += 1
        kids = children.get(a[k - 1] if k else -1, [])
        first = bisect.bisect_right(kids, (p, len(ops)))  # children starting after p
        if first + 1 < len(kids) and kids[first + 1][1] <= u:  # two of them end before u
            out.append(v.id)
    return frozenset(out)


def held_past_cuts(values: tuple[g.Value, ...], ops: tuple[g.Op, ...], cut_afters: list[int]
                   ) -> dict[int, tuple[int, int]]:
    """Activations the user's code keeps referring to after their last forward read (a KV
    cache in the model's output, a list of hidden states, a local variable until its function
    returns), and which cut points they are held across: value id -> (first, last) cut index.
    A recompute region cannot drop them before ``Value.death_unsaved``."""
    last_read = [-1] * len(values)
    for op in ops:
        for vid in op.inputs + op.mutated:
            last_read[vid] = op.index
    out: dict[int, tuple[int, int]] = {}
    for v in values:
        if v.kind != g.ACTIVATION or v.producer < 0:
            continue
        lo = max(v.producer, last_read[v.id])
        hi = len(ops) if v.death_unsaved is None else v.death_unsaved
        first = bisect.bisect_left(cut_afters, lo)
        last = bisect.bisect_left(cut_afters, hi) - 1  # cuts with lo <= after < hi
        if first <= last:
            out[v.id] = (first, last)
    return out


def _call_chains(n_ops: int, calls: tuple[g.ModuleCall, ...]) -> list[tuple[int, ...]]:
    """For each forward op, the indices of the non-leaf calls around it, outermost first."""
    chains: list[tuple[int, ...]] = [()] * n_ops
    order = sorted(range(len(calls)), key=lambda i: (calls[i].start, -calls[i].end))
    stack: list[int] = []
    pos = 0
    for op in range(n_ops):
        while stack and calls[stack[-1]].end <= op:
            stack.pop()
        while pos < len(order) and calls[order[pos]].start <= op:
            i = order[pos]
            pos += 1
            if calls[i].end <= op:
                continue  # an empty call
            while stack and calls[stack[-1]].end <= calls[i].start:
                stack.pop()
            stack.append(i)
        while stack and calls[stack[-1]].end <= op:
            stack.pop()
        chains[op] = tuple(stack)
    return chains
