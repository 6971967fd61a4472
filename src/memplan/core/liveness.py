"""Liveness in the plain run: which forward values are live across each op boundary, and the
candidate cut points (stage boundaries) a plan may choose from: the paper's candidate set C in
Alg. 3, with the bytes a checkpoint there must keep; which values are shared, skips or held."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.jit import jit

I64 = npt.NDArray[np.int64]


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
            out += _spread(sorted(found, key=lambda c: c.after), saved_in, lo, hi, total)
        lo = hi + 1
    return out


# Fine cuts in all, at most, shared among the coarse gaps by their saved bytes: a user's loop
# over leaf modules (the paper's 1024-step LSTM of nn.LSTMCell) gets one cut per step, as a
# model with a module per step does (32 per gap, the old rule, left that LSTM 32-step stages:
# least peak 0.886 GB against 0.360 GB with one cut per step). The optimal planner solves
# identical stages once, but stages that all differ cost it time that grows fast: a flat
# nn.Sequential of 1,200 layers of varying widths planned its least peak in 0.13 s on 129
# stages, 3.1 s on 257, 53 s on 513, over 13 min on 916, for a least peak 2 % lower. So
# unless most chosen stages are of one kind (a loop's steps), at most MAX_FINE_MIXED.
MAX_FINE = 1024
MAX_FINE_MIXED = 128
MIN_FINE = 32  # per gap, whatever its share: never fewer than the old rule


def _spread(found: list[g.CutPoint], saved_in: list[int], lo: int, hi: int,
            forward_saved: int) -> list[g.CutPoint]:
    """At most the gap's share of ``MAX_FINE`` (by saved bytes) of its fine cuts, halved
    until most of their stages are of one kind (``_commonest``) or they are at most its
    share of ``MAX_FINE_MIXED`` (``MIN_FINE`` at least)."""
    total = sum(saved_in[lo : hi + 1])
    most = max(1, MAX_FINE * total // forward_saved)
    mixed = max(MIN_FINE, MAX_FINE_MIXED * total // forward_saved)
    weight = [0]
    prev = lo
    for c in found:
        weight.append(weight[-1] + sum(saved_in[prev : c.after + 1]))
        prev = c.after + 1
    while True:
        chosen = found if len(found) <= most else _runs(found, weight[1:], total, most)
        if most <= mixed or 2 * _commonest(chosen, saved_in, lo) > len(chosen):
            return chosen
        most //= 2


def _runs(found: list[g.CutPoint], weight: list[int], total: int, most: int
          ) -> list[g.CutPoint]:
    """The gap split into ``most`` runs of equal saved bytes (``weight``: saved bytes of the
    gap up to each cut), and the narrowest cut (fewest live bytes; the last on ties) of each
    run. In a loop whose steps save equal bytes, with as many runs as steps, each run is one
    step: the cuts fall at the same place in every step. A cut with nothing saved before it
    in the gap would split off an empty stage, yet be its run's narrowest (the loop's state
    is not made yet): it is never chosen here."""
    runs: dict[int, g.CutPoint] = {}
    for c, w in zip(found, weight):
        if w == 0:
            continue
        run = min(most - 1, (w - 1) * most // total)
        best = runs.get(run)
        if best is None or c.live_bytes <= best.live_bytes:
            runs[run] = c
    return [runs[r] for r in sorted(runs)]


def _commonest(cuts: list[g.CutPoint], saved_in: list[int], lo: int) -> int:
    """How many of the stages the cuts make in their gap are of its commonest kind, told
    apart by their op count, the bytes they save and the live bytes at their end (a loop's
    steps: one kind)."""
    count: dict[tuple[int, int, int], int] = {}
    prev = lo
    for c in cuts:
        kind = (c.after + 1 - prev, sum(saved_in[prev : c.after + 1]), c.live_bytes)
        count[kind] = count.get(kind, 0) + 1
        prev = c.after + 1
    return max(count.values(), default=0)


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
    arrays = ValueArrays.of(values, ops)
    return frozenset(np.flatnonzero(shared_mask(arrays, calls)).tolist())


def skip_values(
    values: tuple[g.Value, ...], ops: tuple[g.Op, ...], calls: tuple[g.ModuleCall, ...]
) -> frozenset[int]:
    """Activations that pass over two or more whole module calls between where they are
    made and where they are last read: a U-Net's encoder outputs (read by the decoder, past
    the blocks in between). A layer's input (made by the layer before, read by this one)
    passes over none; a residual stream added around a block (``x = x + block(x)``) over one.

    Found in the call tree: the innermost call around both the producer and the last reader,
    and its direct child calls lying wholly between them."""
    arrays = ValueArrays.of(values, ops)
    return frozenset(np.flatnonzero(skip_mask(arrays, calls)).tolist())


def held_past_cuts(values: tuple[g.Value, ...], ops: tuple[g.Op, ...], cut_afters: list[int]
                   ) -> dict[int, tuple[int, int]]:
    """Activations the user's code keeps referring to after their last forward read (a KV
    cache in the model's output, a list of hidden states, a local variable until its function
    returns), and which cut points they are held across: value id -> (first, last) cut index.
    A recompute region cannot drop them before ``Value.death_unsaved``."""
    vid, first, last = held_spans(ValueArrays.of(values, ops), np.asarray(cut_afters, np.int64))
    return {v: (a, b) for v, a, b in zip(vid.tolist(), first.tolist(), last.tolist())}


@dataclass(frozen=True)
class ValueArrays:
    """What the scans above read of a Graph, as arrays: per value, per forward read."""

    n_ops: int
    activation: npt.NDArray[np.bool_]  # per value: an activation
    producer: I64  # per value: the forward op making it (-1: none)
    death_unsaved: I64  # per value: Value.death_unsaved (n_ops when None)
    read_op: I64  # (op, value) pairs of the forward ops' inputs
    read_vid: I64
    last_use: I64  # per value: the last forward op reading or writing it (-1: none)

    @classmethod
    def of(cls, values: tuple[g.Value, ...], ops: tuple[g.Op, ...]) -> ValueArrays:
        n_ops, nv = len(ops), len(values)
        read_op, read_vid = pairs([op.inputs for op in ops])
        mut_op, mut_vid = pairs([op.mutated for op in ops])
        last_use = np.full(nv, -1, dtype=np.int64)
        np.maximum.at(last_use, read_vid, read_op)
        np.maximum.at(last_use, mut_vid, mut_op)
        return cls(n_ops, np.array([v.kind == g.ACTIVATION for v in values], dtype=np.bool_),
                   np.array([v.producer for v in values], dtype=np.int64),
                   np.array([n_ops if v.death_unsaved is None else v.death_unsaved
                             for v in values], dtype=np.int64), read_op, read_vid, last_use)


def pairs(lists: Sequence[tuple[int, ...]]) -> tuple[I64, I64]:
    """(owner index, item) pairs of a list of int tuples, as two arrays."""
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    items = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lens.sum()))
    return np.repeat(np.arange(len(lists), dtype=np.int64), lens), items


def _call_array(calls: tuple[g.ModuleCall, ...]) -> tuple[I64, I64]:
    return (np.array([c.start for c in calls], dtype=np.int64),
            np.array([c.end for c in calls], dtype=np.int64))


def shared_mask(va: ValueArrays, calls: tuple[g.ModuleCall, ...]) -> npt.NDArray[np.bool_]:
    """``shared_values`` as a mask over values."""
    starts, ends = _call_array(tuple(c for c in calls if not c.leaf))
    chains, depth = _call_chains(va.n_ops, starts, ends, np.lexsort((-ends, starts)))
    vid, k, outer = _reading_calls(chains, depth, va.read_op, va.read_vid, va.activation,
                                   va.producer)
    # Two reading calls at one depth below the producer's (layers of one model), not one at
    # each (an LSTM cell's h, read by the next layer of its step and by the next step).
    width = max(int(outer.max(initial=0)) + 1, 1)
    keys = np.unique((vid * (int(depth.max(initial=0)) + 1) + k) * width + outer)
    groups, counts = np.unique(keys // width, return_counts=True)
    mask = np.zeros(len(va.activation), dtype=np.bool_)
    mask[groups[counts >= 2] // (int(depth.max(initial=0)) + 1)] = True
    return mask


def skip_mask(va: ValueArrays, calls: tuple[g.ModuleCall, ...]) -> npt.NDArray[np.bool_]:
    """``skip_values`` as a mask over values."""
    starts, ends = _call_array(tuple(c for c in calls if not c.leaf and c.end > c.start))
    chains, depth = _call_chains(va.n_ops, starts, ends, np.lexsort((-ends, starts)))
    last_read = np.full(len(va.activation), -1, dtype=np.int64)
    np.maximum.at(last_read, va.read_vid, va.read_op)
    parent = _parents(chains, depth, starts)
    order = np.lexsort((ends, starts, parent))  # children of each parent by (start, end)
    return _passes_two_calls(chains, depth, ends, parent, order, starts[order], va.activation,
                             va.producer, last_read)


def held_spans(va: ValueArrays, cut_afters: I64) -> tuple[I64, I64, I64]:
    """``held_past_cuts`` as arrays: (value, first cut, last cut), by value id."""
    lo = np.maximum(va.producer, va.last_use)
    first = np.searchsorted(cut_afters, lo, side="left")
    last = np.searchsorted(cut_afters, va.death_unsaved, side="left") - 1
    vid = np.flatnonzero(va.activation & (va.producer >= 0) & (first <= last))
    return vid, first[vid], last[vid]


@jit
def _call_chains(n_ops: int, starts: I64, ends: I64, order: I64) -> tuple[I64, I64]:
    """For each forward op, the indices of the calls around it, outermost first: (chains,
    one row per op padded with -1, depth per op). ``order``: calls by start, longest first."""
    depth = np.zeros(n_ops, np.int64)
    stack = np.empty(len(starts) + 1, np.int64)
    rows = np.full((n_ops, 1), -1, np.int64)
    for fill in range(2):  # the first pass finds the depth, the second writes the rows
        top, pos = 0, 0
        for op in range(n_ops):
            while top and ends[stack[top - 1]] <= op:
                top -= 1
            while pos < len(order) and starts[order[pos]] <= op:
                i = order[pos]
                pos += 1
                if ends[i] <= op:
                    continue  # an empty call
                while top and ends[stack[top - 1]] <= starts[i]:
                    top -= 1
                stack[top] = i
                top += 1
            while top and ends[stack[top - 1]] <= op:
                top -= 1
            depth[op] = top
            if fill:
                rows[op, :top] = stack[:top]
        if not fill:
            rows = np.full((n_ops, max(1, depth.max() if n_ops else 1)), -1, np.int64)
    return rows, depth


@jit
def _common(chains: I64, depth: I64, a: int, b: int) -> int:
    """How many calls the chains of ops a and b share, outermost first."""
    k = 0
    while k < depth[a] and k < depth[b] and chains[a, k] == chains[b, k]:
        k += 1
    return k


@jit
def _reading_calls(chains: I64, depth: I64, read_op: I64, read_vid: I64,
                   activation: npt.NDArray[np.bool_], producer: I64
                   ) -> tuple[I64, I64, I64]:
    """Per forward read of an activation made earlier: (value, depth k at which the reader's
    calls leave the producer's, the reader's call there), where the reader is inside one."""
    n = len(read_op)
    vid, at, outer = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    w = 0
    for p in range(n):
        op, v = read_op[p], read_vid[p]
        m = producer[v]
        if not activation[v] or m < 0 or m >= op:
            continue
        k = _common(chains, depth, op, m)
        if k < depth[op]:
            vid[w], at[w], outer[w] = v, k, chains[op, k]
            w += 1
    return vid[:w], at[:w], outer[:w]


@jit
def _parents(chains: I64, depth: I64, starts: I64) -> I64:
    """Each call's parent call (-1: none), from the chain at its first op."""
    parent = np.full(len(starts), -1, np.int64)
    for i in range(len(starts)):
        row = starts[i]
        for q in range(1, depth[row]):
            if chains[row, q] == i:
                parent[i] = chains[row, q - 1]
    return parent


@jit
def _passes_two_calls(chains: I64, depth: I64, ends: I64, parent: I64, order: I64,
                      kid_start: I64, activation: npt.NDArray[np.bool_], producer: I64, last_read: I64
                      ) -> npt.NDArray[np.bool_]:
    """Values for which two children of the innermost call around their producer and last
    reader start after the producer, the second ending by the last read. ``order``: the
    calls by parent, then (start, end); ``kid_start``: their starts in that order."""
    nc = len(parent)
    offset = np.zeros(nc + 2, np.int64)  # children of parent p: order[offset[p+1]:offset[p+2]]
    for i in range(nc):
        offset[parent[i] + 2] += 1
    for p in range(1, nc + 2):
        offset[p] += offset[p - 1]
    out = np.zeros(len(producer), np.bool_)
    for v in range(len(producer)):
        p, u = producer[v], last_read[v]
        if not activation[v] or p < 0 or u <= p + 1:
            continue
        k = _common(chains, depth, p, u)
        par = chains[p, k - 1] if k else -1
        lo, hi = offset[par + 1], offset[par + 2]
        first = lo + np.searchsorted(kid_start[lo:hi], p, side="right")  # starting after p
        if first + 1 < hi and ends[order[first + 1]] <= u:
            out[v] = True
    return out
