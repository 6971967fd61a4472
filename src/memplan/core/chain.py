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

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.checkpoints import stage_bytes
from memplan.core.graph_arrays import GraphArrays, flat, graph_arrays
from memplan.core.stages import Stages, exact_sum, stages

I64 = npt.NDArray[np.int64]

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
    # The runtime replays a recomputed scope op by op and frees each value after its last
    # use, where the user's Python keeps locals to the end of a call: transients of a replay
    # are smaller. None: as the plain ones (tf, tf0).
    tfr: I64 | None = None  # a kept stage replayed in a region's backward (saves kept)
    tfr0: I64 | None = None  # a nested region's ops replayed inside its parent's replay
    tfs: I64 | None = None  # a drop-cheap stage's forward (cheap outputs not kept)
    # How the runtime finds each stage's end (CutPoint.kind); () when all are "call".
    kinds: tuple[str, ...] = ()
    # Bytes saved for backward, made no later than the stage and read no more, that the user's
    # code holds across its cut and no other (an LSTM's previous cell state until the step
    # returns): not a checkpoint's (a region's tape does not keep them), but a region ending
    # at the cut leaves them to the next stage's forward. None: zeros.
    xh: I64 | None = None
    # Forward FLOPs a top-level region ending at the stage does not replay: the runtime stops
    # a replay once it has made every value the region saves (as torch's checkpoint does),
    # after the last op up to the stage's end making a value an op up to it saves (or
    # writing one in place). None: replays run whole.
    fstop: I64 | None = None

    @property
    def n(self) -> int:
        return int(self.f.shape[0])

    @property
    def tf_replay(self) -> I64:
        return self.tf if self.tfr is None else self.tfr

    @property
    def tf0_replay(self) -> I64:
        return self.tf0 if self.tfr0 is None else self.tfr0

    @property
    def held_end(self) -> I64:
        return np.zeros_like(self.x) if self.xh is None else self.xh

    @property
    def tf_sac(self) -> I64:
        return self.tf if self.tfs is None else self.tfs

    @property
    def need_sac_b(self) -> I64:
        """Bytes above the stage's start at a drop-cheap stage's backward, bounded from above:
        its kept and recomputed values (xsac_b) at its plain backward's peak transient (the
        replay happens when backward first reads a recomputed value, usually earlier)."""
        return self.xsac_b + self.gb + self.tb


def clean_cuts(graph: g.Graph) -> list[int]:
    """Indices of the cut points usable as chain boundaries: each cut's live values must all
    be made after the previous chosen cut (a long skip makes a cut unusable: Sec. 4.3's chain
    assumption; the ILP planner handles such graphs). Shared values (``liveness.
    shared_values``) do not count: they are resident anyway. The end of the forward is always
    one."""
    ga = graph_arrays(graph)
    chosen: list[int] = []
    prev_after = -1
    last = len(ga.cut_after) - 1
    for i, (after, first_made) in enumerate(zip(ga.cut_after.tolist(), ga.cut_min_producer.tolist())):
        if i == last or first_made > prev_after:
            chosen.append(i)
            prev_after = after
    return chosen


def build_chain(graph: g.Graph, cuts: list[int] | None = None) -> Chain:
    """The chain over the given cut-point indices (default: all clean cuts)."""
    ga = graph_arrays(graph)
    cut_idx = np.array(clean_cuts(graph) if cuts is None else list(cuts), dtype=np.int64)
    st = stages(ga, cut_idx)
    x, xbar, d, xsac, xsac_b, held, xh, res = stage_bytes(graph, ga, st, cut_idx)
    f, b, fcheap, cheap = _stage_flops(ga, st)
    tf, tf0, tfr, tfr0, tfs = _forward_transients(ga, st, held, res)
    fstop = _stop_flops(graph, ga, st)
    tb, gb = _backward_transients(ga, st, xbar, d)
    # Stages wholly after the model's forward (the loss) run outside the model, where the
    # runtime cannot recompute: make recomputing them cost more than any plain step.
    n_model = graph.forward.ops if graph.forward else None
    if n_model is not None and bool((st.firsts >= n_model).any()):
        outside = st.firsts >= n_model
        big = int(ga.base_bytes + xbar.sum() + tf.max() + tb.max() + np.abs(gb).max()) + 1
        xsac, xsac_b, tf0, tfr0, tfs = (np.where(outside, big, a)
                                         for a in (xsac, xsac_b, tf0, tfr0, tfs))
    return Chain(
        fingerprint=ga.fingerprint, first=st.firsts, last=st.afters.copy(),
        modules=tuple(graph.cut_points[int(i)].module for i in cut_idx), f=f, b=b, x=x,
        xbar=xbar, d=d, xsac=xsac, xsac_b=xsac_b, fcheap=fcheap, tf=tf, tf0=tf0, tb=tb, gb=gb,
        base_bytes=ga.base_bytes, step_flops=ga.step_flops, cheap_ops=cheap, tfr=tfr,
        tfr0=tfr0, tfs=tfs, kinds=tuple(graph.cut_points[int(i)].kind for i in cut_idx), xh=xh,
        fstop=fstop,
    )


def _stop_flops(graph: g.Graph, ga: GraphArrays, st: Stages) -> I64:
    """``Chain.fstop``: the FLOPs of the ops after the last one, up to each stage's end, that
    makes an activation an op up to there saves or writes one saved in place (a region
    whose replay would stop before its first op is never replayed: the planner clamps)."""
    made = np.full(ga.n_ops, -1, dtype=np.int64)
    op_i, vid = flat(graph.ops, "saved")
    mine = ga.activation[vid] & (ga.producer[vid] >= 0)
    np.maximum.at(made, op_i[mine], ga.producer[vid[mine]])
    saved_any = np.zeros(len(graph.values), dtype=np.bool_)
    saved_any[vid] = True
    op_m, vid_m = flat(graph.ops, "mutated")
    writes = ga.activation[vid_m] & saved_any[vid_m]
    made[op_m[writes]] = op_m[writes]
    stop = np.maximum.accumulate(made) if ga.n_ops else made
    cum = np.concatenate(([0], np.cumsum(ga.fwd_flops)))
    return (cum[st.afters + 1] - cum[stop[st.afters] + 1]).astype(np.int64)



def _stage_flops(ga: GraphArrays, st: Stages
                 ) -> tuple[I64, I64, I64, tuple[tuple[int, ...], ...]]:
    """Forward and backward FLOPs per stage, the FLOPs drop-cheap recomputes, and its ops."""
    k, stage_of_op = st.k, st.stage_of_op
    ops_all = np.ones(ga.n_ops, dtype=np.bool_)
    f = exact_sum(stage_of_op, ga.fwd_flops, ops_all, k)
    b = exact_sum(stage_of_op, ga.bwd_flops, ops_all, k)
    cheap_mask = ~ga.expensive & ga.has_outputs
    fcheap = exact_sum(stage_of_op, ga.fwd_flops, cheap_mask, k)
    cheap_idx = np.nonzero(cheap_mask)[0]
    cheap_stage = stage_of_op[cheap_idx]
    order = np.argsort(cheap_stage, kind="stable")
    bounds = np.cumsum(np.bincount(cheap_stage, minlength=k))[:-1]
    cheap = tuple(tuple(p.tolist()) for p in np.split(cheap_idx[order], bounds))
    return f, b, fcheap, cheap


def _forward_transients(ga: GraphArrays, st: Stages, held: I64, res_read: I64
                        ) -> tuple[I64, I64, I64, I64, I64]:
    """Peaks above a stage's start: tf (plain, from the trace), tf0 (nothing saved: spans
    birth .. death, or last forward use when kept), and the runtime's replays (``replay``):
    tfr (a kept stage replayed: saved values stay), tfr0 (a nested region's ops replayed:
    each value lives to its last use), tfs (a drop-cheap stage's first forward: expensive
    outputs kept, the rest die as in the plain run). ``held``, ``res``: per cut, bytes only
    held across it (no checkpoint's: the next stage's first forward holds them) and resident
    bytes counted in its checkpoint (so not again as resident in the next stage)."""
    tl, died, firsts, span = ga.timeline, ga.died, st.firsts, st.span
    start = np.where(firsts > 0, tl[np.maximum(firsts - 1, 0)] - died[np.maximum(firsts - 1, 0)],
                     tl[0] - ga.born0)
    tf = np.maximum.reduceat(tl[:span], firsts) - start
    # Kept values die, when nothing is saved, as the user's code drops them (capture records
    # it; graphs before schema 3: at their last forward use).
    unsaved = np.where(ga.death_unsaved < ga.death, ga.death_unsaved, -1)
    end = np.where(st.retained,
                   np.maximum(np.where(ga.last_fwd_use >= 0, ga.last_fwd_use, ga.birth), unsaved),
                   ga.death)
    end = np.maximum(end, ga.birth)
    last_use = np.maximum(np.where(ga.last_fwd_use >= 0, ga.last_fwd_use, ga.birth), ga.birth)
    exp_value = np.zeros(len(ga.nbytes), dtype=np.bool_)
    exp_value[ga.out_vid[ga.expensive[ga.out_op]]] = True
    stage_end = st.afters[st.v_stage]
    tf0, tfr, tfr0, tfs = (
        _stage_peaks(ga.birth, end_, st.made, ga.nbytes, firsts, st.afters, st.v_stage, span,
                     ga.n_ops)
        for end_ in (end, np.where(st.retained, stage_end, last_use), last_use,
                     np.where(exp_value, stage_end, end)))
    # Resident values made before a stage and not yet dead are there during it.
    res = ga.resident & (ga.producer >= 0)
    change = np.zeros(ga.n_ops + 2, dtype=np.int64)
    np.add.at(change, ga.producer[res] + 1, ga.nbytes[res])
    ends = ga.resident_end[res]
    dies = ends < ga.n_ops
    np.subtract.at(change, ends[dies] + 1, ga.nbytes[res][dies])
    sh_in = np.cumsum(change)[firsts] - np.concatenate(([0], res_read[:-1]))
    held_in = np.concatenate(([0], held[:-1]))
    return (tf + sh_in + held_in, tf0 + sh_in + held_in, tfr + sh_in, tfr0 + sh_in,
            tfs + sh_in + held_in)


def _backward_transients(ga: GraphArrays, st: Stages, xbar: I64, d: I64) -> tuple[I64, I64]:
    """tb: the peak of a stage's backward above the live bytes when it starts; gb: the
    gradient-side bytes (parameter grads so far, incoming grads) at its start. Backward ops
    are grouped by the stage whose gradient they compute."""
    k, n_ops, tl, died = st.k, ga.n_ops, ga.timeline, ga.died
    go = ga.grad_of
    bstage = np.minimum.accumulate(np.where(go >= 0, st.stage_of_op[np.maximum(go, 0)], k - 1))
    neg = -bstage
    s_all = -np.arange(k)
    b_start = np.searchsorted(neg, s_all, side="left")
    b_end = np.searchsorted(neg, s_all, side="right")
    has = b_end > b_start
    e0b = np.where(has, n_ops + b_start, np.minimum(n_ops + b_end, len(tl)))
    lb_pre = tl[e0b - 1] - died[e0b - 1]
    tb = np.zeros(k, dtype=np.int64)
    if has.any():
        starts = np.sort(b_start[has])
        seg_max = np.maximum.reduceat(tl[n_ops:], starts)
        order_s = np.argsort(b_start[has])
        tb_has = np.empty(int(has.sum()), dtype=np.int64)
        tb_has[order_s] = seg_max
        tb[has] = tb_has - lb_pre[has]
    resident = np.cumsum(xbar - np.concatenate(([0], d[:-1])))
    return tb, lb_pre - ga.base_bytes - resident


def _stage_peaks(birth: I64, end: I64, made: npt.NDArray[np.bool_], nbytes: I64, firsts: I64,
                 afters: I64, v_stage: I64, span: int, n_ops: int) -> I64:
    """Per stage: the peak over its ops of the bytes of values it made that are alive
    (birth <= op <= end, clipped to the stage)."""
    b0 = np.maximum(birth, firsts[v_stage])[made]
    e0 = np.minimum(np.maximum(end, birth), afters[v_stage])[made] + 1
    delta = np.zeros(n_ops + 2, dtype=np.int64)
    np.add.at(delta, b0, nbytes[made])
    np.subtract.at(delta, e0, nbytes[made])
    return np.maximum.reduceat(np.cumsum(delta)[:span], firsts)


