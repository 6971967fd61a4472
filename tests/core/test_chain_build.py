"""The vectorised ``build_chain`` (numpy over the Graph's arrays, for planning LSTM T=2048 in
under a second) gives exactly the arrays of the per-value loops it replaced, kept below as the
reference (with resident values and Python-held live sets since issue 11), on every test model,
clean and not (a U-Net's long skips), and on arbitrary cuts."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.core import chain as C
from memplan.core import graph as g
from memplan.core import liveness as L
from memplan.core.graph_arrays import graph_arrays
from memplan.core.ops import is_expensive
from tests.core.graphs import NAMES, tiny

ARRAYS = ("first", "last", "f", "b", "x", "xbar", "d", "xsac", "xsac_b", "fcheap", "tf", "tf0",
          "tb", "gb", "held_end")


def reference_resident(graph: g.Graph) -> tuple[set[int], list[set[int]], dict[int, int]]:
    """Resident values, each cut's live set as the chain counts it, and when a resident value
    leaves (the forward op it dies at when never saved and not shared; absent: never)."""
    shared = L.shared_values(graph.values, graph.ops, graph.module_calls)
    held = L.held_past_cuts(graph.values, graph.ops, [c.after for c in graph.cut_points])

    cuts = graph.cut_points

    def held_long(v: int, a: int, b: int) -> bool:  # two call cuts at the outermost depth
        death = graph.values[v].death_unsaved  # (op cuts too, held to the forward's last op)
        to_end = death is None or death == 0 or death >= len(graph.ops) - 1
        depths = [c.depth for c in cuts[a:b + 1]  # crossed, or died at
                  if c.kind == g.CALL or (c.kind == g.OP and to_end)]
        died_at = [c.depth for c in cuts[b + 1:b + 2]
                   if c.kind == g.CALL and c.after == (len(graph.ops) if death is None else death)]
        return len(depths) > 0 and sum(d == min(depths + died_at) for d in depths) >= 2

    resident = (set(shared) | set(L.skip_values(graph.values, graph.ops, graph.module_calls))
                | {v for v, (a, b) in held.items() if held_long(v, a, b)})
    live = [set(c.live) for c in graph.cut_points]
    for v, (a, b) in held.items():
        if v not in resident:
            for i in range(a, b + 1):
                live[i].add(v)
    n_ops = len(graph.ops)
    for v in graph.values:  # crossing two cuts, never saved
        death = v.death
        if sum(v.id in cut for cut in live) >= 2 and death is not None and death < n_ops:
            resident.add(v.id)
    live = [cut - resident for cut in live]
    leaves = {v: graph.values[v].death for v in resident if v not in shared
              and graph.values[v].death is not None and graph.values[v].death < n_ops}
    return resident, live, leaves  # type: ignore[return-value]


def reference_cut_sets(graph: g.Graph, cut_idx: list[int]) -> tuple[list[set[int]], list[int]]:
    """Per chosen cut: the values only held there (not read after it; a saved one only where
    it is held across no other chosen cut), and the bytes of the resident values dying in the
    forward that are read across it (a region starting there keeps them on its tape)."""
    _, cut_live, leaves = reference_resident(graph)
    n_ops = len(graph.ops)
    held = [cut_live[i] - set(graph.cut_points[i].live) for i in cut_idx]
    saved = {v for h in held for v in h if graph.values[v].death is None
             or graph.values[v].death >= n_ops}
    held = [{v for v in h if v not in saved or sum(v in o for o in held) == 1} for h in held]
    reads = [set(graph.cut_points[i].live) & set(leaves) for i in cut_idx]
    res = [sum(graph.values[v].nbytes for v in r) for r in reads]
    return held, res


def reference_clean_cuts(graph: g.Graph) -> list[int]:
    """By what restarting there reads: a cut's own live set, resident values excluded (values
    only held across it count in its bytes, not here)."""
    resident, _, _ = reference_resident(graph)
    chosen: list[int] = []
    prev_after = -1
    last = len(graph.cut_points) - 1
    for i, cut in enumerate(graph.cut_points):
        reads = set(cut.live) - resident
        if i == last or all(graph.values[v].producer > prev_after for v in reads):
            chosen.append(i)
            prev_after = cut.after
    return chosen



def reference_build_chain(graph: g.Graph, cuts: list[int] | None = None) -> C.Chain:
    """The per-value Python loops build_chain was before vectorising (kept verbatim)."""
    cut_idx = reference_clean_cuts(graph) if cuts is None else list(cuts)
    resident, cut_live, leaves = reference_resident(graph)
    n_ops = len(graph.ops)
    afters = [graph.cut_points[i].after for i in cut_idx]
    k = len(afters)
    stage_of_op = np.zeros(n_ops, dtype=np.int64)
    firsts = [0] + [a + 1 for a in afters[:-1]]
    for s, (lo, hi) in enumerate(zip(firsts, afters)):
        stage_of_op[lo : hi + 1] = s
    timeline = graph.live_bytes_timeline()
    n_events = len(timeline)
    died = [0] * (n_events + 1)
    base = 0
    kept = np.zeros(k, dtype=np.int64)  # retained (R) bytes made in the stage
    last_fwd_use: dict[int, int] = {}
    for op in graph.ops:
        for vid in op.inputs + op.mutated:
            last_fwd_use[vid] = op.index
    tf0_acc: list[list[tuple[int, int, int]]] = [[] for _ in range(k)]  # (birth, end, bytes)
    for v in graph.values:
        if v.death is not None:
            died[v.death] += v.nbytes
        if v.birth < 0:
            base += v.nbytes
        if v.kind == g.ACTIVATION and v.producer >= 0:
            s = int(stage_of_op[v.producer])
            retained = v.death is None or v.death >= n_ops
            if retained and v.id not in resident:
                kept[s] += v.nbytes
            unsaved = v.death_unsaved if v.death_unsaved is not None and (
                v.death is None or v.death_unsaved < v.death) else -1
            end = (v.death if not retained and v.death is not None
                   else max(last_fwd_use.get(v.id, v.birth), unsaved))
            tf0_acc[s].append((v.birth, max(end, v.birth), v.nbytes))
    held, res = reference_cut_sets(graph, cut_idx)
    x = np.array([sum(graph.values[v].nbytes for v in cut_live[i] - held[s]) + res[s]
                  for s, i in enumerate(cut_idx)], dtype=np.int64)
    x_kept = np.zeros(k, dtype=np.int64)
    xsac = np.zeros(k, dtype=np.int64)
    xsac_b = np.zeros(k, dtype=np.int64)
    fcheap = np.zeros(k, dtype=np.int64)
    f = np.zeros(k, dtype=np.int64)
    bfl = np.zeros(k, dtype=np.int64)
    cheap: list[list[int]] = [[] for _ in range(k)]
    expensive_out: list[set[int]] = [set() for _ in range(k)]
    for op in graph.ops:
        s = int(stage_of_op[op.index])
        f[s] += op.fwd_flops
        bfl[s] += op.bwd_flops
        if is_expensive(op.target):
            expensive_out[s].update(set(op.outputs) - resident)
        elif op.outputs:
            fcheap[s] += op.fwd_flops
            cheap[s].append(op.index)
    for s, ci in enumerate(cut_idx):
        live = cut_live[ci] - held[s]
        for vid in sorted(live):
            v = graph.values[vid]
            if v.death is None or v.death >= n_ops:
                x_kept[s] += v.nbytes
        not_kept_exp, exp_kept = 0, 0
        for vid in sorted(expensive_out[s] - live):
            v = graph.values[vid]
            if v.death is None or v.death >= n_ops:
                exp_kept += v.nbytes
            else:
                not_kept_exp += v.nbytes
        xsac[s] = x[s] + exp_kept + not_kept_exp
        xsac_b[s] = kept[s] + (x[s] - x_kept[s]) + not_kept_exp
    xbar = kept + (x - x_kept)
    d = x - x_kept
    # Forward transients (plain: from the trace; nothing saved: from birth/last-use spans).
    tf = np.zeros(k, dtype=np.int64)
    tf0 = np.zeros(k, dtype=np.int64)
    for s in range(k):
        lo, hi = firsts[s], afters[s]
        start = timeline[lo - 1] - died[lo - 1] if lo > 0 else timeline[0] - _born_at(graph, 0)
        # resident values made before the stage and still there
        there = sum(graph.values[v].nbytes for v in resident if graph.values[v].producer >= 0
                    and graph.values[v].producer < lo and leaves.get(v, n_ops) >= lo)
        # ... less those counted in the previous cut's bytes, plus the values only held there
        there += (sum(graph.values[v].nbytes for v in held[s - 1] if graph.values[v].death
                      is not None and graph.values[v].death < n_ops) - res[s - 1]) if s else 0
        tf[s] = max(timeline[lo : hi + 1]) - start + there
        tf0[s] = _span_peak(tf0_acc[s], lo, hi) + there
    # Backward: group backward ops by the stage whose gradient they compute.
    n_b = len(graph.backward_ops)
    bstage = np.zeros(n_b, dtype=np.int64)
    cur = k - 1
    for j, op in enumerate(graph.backward_ops):
        if op.grad_of >= 0:
            cur = min(cur, int(stage_of_op[op.grad_of]))
        bstage[j] = cur
    tb = np.zeros(k, dtype=np.int64)
    lb_pre = np.zeros(k, dtype=np.int64)
    for s in range(k):
        idx = np.nonzero(bstage == s)[0]
        if idx.size == 0:  # no backward ops of its own: starts where the next one does
            e0 = n_ops + int(np.searchsorted(-bstage, -s, side="right"))
            e0 = min(e0, n_events)
            lb_pre[s], tb[s] = timeline[e0 - 1] - died[e0 - 1], 0
            continue
        e0, e1 = n_ops + int(idx[0]), n_ops + int(idx[-1])
        pre = timeline[e0 - 1] - died[e0 - 1]
        lb_pre[s] = pre
        tb[s] = max(timeline[e0 : e1 + 1]) - pre
    resident = np.cumsum(xbar - np.concatenate(([0], d[:-1])))
    gb = lb_pre - base - resident
    return C.Chain(
        fingerprint=graph.fingerprint, first=np.array(firsts, dtype=np.int64),
        last=np.array(afters, dtype=np.int64),
        modules=tuple(graph.cut_points[i].module for i in cut_idx), f=f, b=bfl, x=x, xbar=xbar,
        d=d, xsac=xsac, xsac_b=xsac_b, fcheap=fcheap, tf=tf, tf0=tf0, tb=tb, gb=gb,
        base_bytes=base, step_flops=graph.step_flops,
        cheap_ops=tuple(tuple(c) for c in cheap),
        xh=np.array([sum(graph.values[v].nbytes for v in h if graph.values[v].death is None
                         or graph.values[v].death >= n_ops) for h in held], dtype=np.int64),
    )


def _born_at(graph: g.Graph, event: int) -> int:
    return sum(v.nbytes for v in graph.values if v.birth == event)


def _span_peak(spans: list[tuple[int, int, int]], lo: int, hi: int) -> int:
    """Peak over events lo..hi of the bytes of spans alive (birth <= e <= end)."""
    if not spans:
        return 0
    delta = np.zeros(hi - lo + 2, dtype=np.int64)
    for birth, end, nbytes in spans:
        delta[max(birth, lo) - lo] += nbytes
        delta[min(end, hi) - lo + 1] -= nbytes
    return int(np.cumsum(delta)[:-1].max())


PINNED = ("xsac", "xsac_b", "tf0")  # made prohibitive after the model's forward (the loss)


def _same(a: C.Chain, b: C.Chain, n_model: int | None = None) -> None:
    inside = np.ones(a.n, dtype=bool) if n_model is None else a.first < n_model
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == np.int64, name
        if name in PINNED:
            assert np.array_equal(x[inside], y[inside]), name
            assert (x[~inside] > a.xbar.sum()).all(), name  # never worth recomputing
        else:
            assert np.array_equal(x, y), name
    for name in ("fingerprint", "modules", "base_bytes", "step_flops", "cheap_ops"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("name", NAMES)
def test_build_chain_equals_reference(name: str) -> None:
    graph = tiny(name)
    assert C.clean_cuts(graph) == reference_clean_cuts(graph), name
    n_model = (graph.forward.ops if graph.forward else None)
    _same(C.build_chain(graph), reference_build_chain(graph), n_model)
    every = list(range(len(graph.cut_points)))  # not clean where skips cross cuts
    _same(C.build_chain(graph, every), reference_build_chain(graph, every), n_model)
    odd = every[1::2] if every[-1] % 2 else every[1::2] + [every[-1]]
    _same(C.build_chain(graph, odd), reference_build_chain(graph, odd), n_model)


def test_graph_arrays_are_cached_per_graph() -> None:
    graph = tiny("lstm")
    assert graph_arrays(graph) is graph_arrays(graph)
    assert graph_arrays(graph).timeline.tolist() == graph.live_bytes_timeline()
    assert C.build_chain(tiny("calibration")).n == 9
