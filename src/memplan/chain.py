"""The chain (stage) view of a Graph and the memory/cost model of a plan: torch-free.

A plan splits the forward at cut points into stages and runs each stage in one of three modes
(the paper's mirror count m(v), Alg. 2):

* ``keep``: run plainly, autograd keeps what it saves (m = 0);
* ``drop-cheap``: a one-stage non-reentrant checkpoint with a selective policy: outputs of
  expensive ops (conv, matmul) are kept, cheap ones recomputed in backward (Sec. 4.2);
* inside a ``recompute`` region: a non-reentrant ``checkpoint`` over stages s..e; only its
  input is kept; in backward the region's body is re-run (nested regions inside it again only
  keep their inputs) and backpropagated (Alg. 1, recursion of Sec. 4.4).

All costs come from the plain eager trace in the Graph. ``simulate`` predicts a plan's peak
with exactly the model the optimal planner optimises (``planners.optimal``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import numpy.typing as npt

from memplan import graph as g

I64 = npt.NDArray[np.int64]

# Ops whose outputs drop-cheap keeps (Sec. 4.2; Korthikanti et al.: keep matmuls, recompute
# softmax/dropout/norms/pointwise).
EXPENSIVE = ("convolution", "aten.mm.", "addmm", "bmm", "matmul", "linear", "scaled_dot_product",
             "flash_attention", "efficient_attention")


def is_expensive(target: str) -> bool:
    return any(key in target for key in EXPENSIVE)


@dataclass
class Chain:
    """Per-stage costs (arrays of length K, bytes and FLOPs). Stage s is forward ops
    ``first[s] .. last[s]``; its output boundary is the Graph's cut after ``last[s]``."""

    fingerprint: str
    first: I64
    last: I64
    modules: tuple[str, ...]
    f: I64  # forward FLOPs
    b: I64  # backward FLOPs
    x: I64  # bytes live across the cut after the stage (a checkpoint's size)
    xbar: I64  # bytes a plain run of the stage keeps for backward, its output included
    d: I64  # part of x nobody saves: freed once the next plain stage has read it
    xsac: I64  # bytes a drop-cheap stage keeps (expensive ops' outputs and its output)
    xsac_b: I64  # bytes resident at a drop-cheap stage's backward (kept + recomputed)
    fcheap: I64  # FLOPs a drop-cheap stage recomputes
    tf: I64  # forward transient of a plain run, above the live bytes at the stage's start
    tf0: I64  # the same when nothing is saved (inside a region's first forward)
    tb: I64  # backward transient above the live bytes when the stage's backward starts
    gb: I64  # gradient-side bytes (param grads so far, incoming grads) at its backward start
    base_bytes: int  # parameters, buffers, inputs: live all step
    step_flops: int
    cheap_ops: tuple[tuple[int, ...], ...] = field(default=())  # drop-cheap's recomputed ops

    @property
    def n(self) -> int:
        return int(self.f.shape[0])


def clean_cuts(graph: g.Graph) -> list[int]:
    """Indices of the cut points usable as chain boundaries: each cut's live values must all
    be made after the previous chosen cut (a long skip makes a cut unusable: Sec. 4.3's chain
    assumption; the ILP planner handles such graphs). The end of the forward is always one."""
    chosen: list[int] = []
    prev_after = -1
    last = len(graph.cut_points) - 1
    for i, cut in enumerate(graph.cut_points):
        if i == last or all(graph.values[v].producer > prev_after for v in cut.live):
            chosen.append(i)
            prev_after = cut.after
    return chosen


def build_chain(graph: g.Graph, cuts: list[int] | None = None) -> Chain:
    """The chain over the given cut-point indices (default: all clean cuts)."""
    cut_idx = clean_cuts(graph) if cuts is None else list(cuts)
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
            if retained:
                kept[s] += v.nbytes
            end = v.death if not retained and v.death is not None else last_fwd_use.get(v.id, v.birth)
            tf0_acc[s].append((v.birth, max(end, v.birth), v.nbytes))
    x = np.array([graph.cut_points[i].live_bytes for i in cut_idx], dtype=np.int64)
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
            expensive_out[s].update(op.outputs)
        elif op.outputs:
            fcheap[s] += op.fwd_flops
            cheap[s].append(op.index)
    for s, ci in enumerate(cut_idx):
        live = set(graph.cut_points[ci].live)
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
        tf[s] = max(timeline[lo : hi + 1]) - start
        tf0[s] = _span_peak(tf0_acc[s], lo, hi)
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
    return Chain(
        fingerprint=graph.fingerprint, first=np.array(firsts, dtype=np.int64),
        last=np.array(afters, dtype=np.int64),
        modules=tuple(graph.cut_points[i].module for i in cut_idx), f=f, b=bfl, x=x, xbar=xbar,
        d=d, xsac=xsac, xsac_b=xsac_b, fcheap=fcheap, tf=tf, tf0=tf0, tb=tb, gb=gb,
        base_bytes=base, step_flops=graph.step_flops,
        cheap_ops=tuple(tuple(c) for c in cheap),
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


# --- schedules -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keep:
    stage: int


@dataclass(frozen=True)
class DropCheap:
    stage: int


@dataclass(frozen=True)
class Region:
    start: int
    end: int  # inclusive
    body: tuple[Item, ...]


Item = Union[Keep, DropCheap, Region]


def item_start(it: Item) -> int:
    return it.start if isinstance(it, Region) else it.stage


def item_end(it: Item) -> int:
    return it.end if isinstance(it, Region) else it.stage


def simulate(chain: Chain, schedule: tuple[Item, ...]) -> tuple[int, int]:
    """(peak bytes, forward FLOPs executed incl. recomputation) of a schedule: the model the
    optimal planner optimises, evaluated in exact bytes."""
    validate(chain, schedule)
    peak, flops = _run(chain, schedule, 0, chain.base_bytes, False, 0)
    return peak, flops


def _run(c: Chain, items: tuple[Item, ...], pos: int, used: int, droppable: bool,
         gfwd: int) -> tuple[int, int]:
    """Forward through the items in order, then each item's backward (nesting recurses)."""
    peak, flops = -(1 << 62), 0
    for it in items[pos:]:
        if isinstance(it, Keep):
            s = it.stage
            freed = int(c.d[s - 1]) if droppable and s > 0 else 0
            now = used + int(c.xbar[s]) - freed
            peak = max(peak, used + gfwd + int(c.tf[s]), now + int(c.gb[s] + c.tb[s]))
            flops += int(c.f[s])
        elif isinstance(it, DropCheap):
            s = it.stage
            now = used + int(c.xsac[s])
            peak = max(peak, used + gfwd + int(c.tf[s]),
                       used + int(c.xsac_b[s] + c.gb[s] + c.tb[s]))
            flops += int(c.f[s] + c.fcheap[s])
        else:
            s, e = it.start, it.end
            fwd = max(int(c.tf0[k]) + (int(c.x[k - 1]) if k > s else 0) for k in range(s, e + 1))
            now = used + int(c.x[e])
            p_body, f_body = _run(c, it.body, 0, used, False, int(c.gb[e]))
            peak = max(peak, used + gfwd + fwd, p_body)
            flops += int(c.f[s : e + 1].sum()) + f_body
        used, droppable = now, True
    return peak, flops


def validate(chain: Chain, schedule: tuple[Item, ...], start: int = 0, end: int | None = None,
             top: bool = True) -> None:
    """Items must tile stages start..end in order; regions never end a sequence; drop-cheap
    only at top level (a selective region nested in a recomputed one would keep its cache)."""
    from memplan.errors import MemplanError

    end = chain.n - 1 if end is None else end
    pos = start
    for i, it in enumerate(schedule):
        if item_start(it) != pos or item_end(it) < item_start(it):
            raise MemplanError(f"schedule does not tile stages {start}..{end} at item {i}: {it}")
        if isinstance(it, Region):
            if i == len(schedule) - 1:
                raise MemplanError(f"a recompute region cannot end its sequence: {it}")
            validate(chain, it.body, it.start, it.end, top=False)
        if isinstance(it, DropCheap) and not top:
            raise MemplanError(f"drop-cheap stage {it.stage} is nested in a recompute region")
        pos = item_end(it) + 1
    if pos != end + 1:
        raise MemplanError(f"schedule covers stages {start}..{pos - 1}, expected ..{end}")


def plain_schedule(chain: Chain) -> tuple[Item, ...]:
    return tuple(Keep(s) for s in range(chain.n))


def to_dict(it: Item) -> dict[str, Any]:
    if isinstance(it, Keep):
        return {"kind": "keep", "stage": it.stage}
    if isinstance(it, DropCheap):
        return {"kind": "drop-cheap", "stage": it.stage}
    return {"kind": "recompute", "start": it.start, "end": it.end,
            "body": [to_dict(b) for b in it.body]}


def from_dict(d: dict[str, Any]) -> Item:
    kind = d["kind"]
    if kind == "keep":
        return Keep(int(d["stage"]))
    if kind == "drop-cheap":
        return DropCheap(int(d["stage"]))
    return Region(int(d["start"]), int(d["end"]), tuple(from_dict(b) for b in d["body"]))
