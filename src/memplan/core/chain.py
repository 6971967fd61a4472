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

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.liveness import held_past_cuts, shared_values, skip_values
from memplan.core.ops import is_expensive

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


@dataclass(frozen=True)
class GraphArrays:
    """A Graph's fields as numpy arrays (one pass over its Python objects), its live-bytes
    timeline and fingerprint: what ``build_chain`` reads, computed once per Graph object."""

    fingerprint: str
    n_ops: int
    nbytes: I64  # per value
    birth: I64
    death: I64  # NO_DEATH when alive after the step
    death_unsaved: I64  # the same had nothing been saved (Value.death_unsaved)
    producer: I64
    activation: npt.NDArray[np.bool_]
    last_fwd_use: I64  # last forward op reading or writing the value, -1 if none
    fwd_flops: I64  # per forward op
    bwd_flops: I64
    expensive: npt.NDArray[np.bool_]
    has_outputs: npt.NDArray[np.bool_]
    out_op: I64  # (op, value) pairs of the forward ops' outputs
    out_vid: I64
    grad_of: I64  # per backward op
    timeline: I64  # live bytes per event (Graph.live_bytes_timeline)
    died: I64  # bytes freed at each event (length n_events + 1)
    born0: int  # bytes born at event 0
    base_bytes: int
    step_flops: int
    cut_after: I64
    cut_bytes: I64  # a cut's live bytes as the chain counts them (``_resident``)
    cut_min_producer: I64  # earliest producer among a cut's live values (n_ops if none)
    cut_of: I64  # (cut, value) pairs of those live sets
    cut_live: I64
    held_of: I64  # (cut, value) pairs of them only held there: past their last read
    held_vid: I64
    res_of: I64  # (cut, value) pairs of resident values read across a cut, dead by the backward
    res_vid: I64
    resident: npt.NDArray[np.bool_]  # per value: resident, no stage's bytes (``_resident``)
    resident_end: I64  # a resident value's last forward op (NO_DEATH: into the backward)


NO_DEATH = np.iinfo(np.int64).max
_ARRAYS: dict[int, tuple[weakref.ref[g.Graph], GraphArrays]] = {}


def graph_arrays(graph: g.Graph) -> GraphArrays:
    """The arrays of ``graph``, cached while the Graph object lives (Graphs are immutable)."""
    hit = _ARRAYS.get(id(graph))
    if hit is not None and hit[0]() is graph:
        return hit[1]
    ga = _extract(graph)
    key = id(graph)
    _ARRAYS[key] = (weakref.ref(graph, lambda _r: _ARRAYS.pop(key, None)), ga)
    return ga


def _ints(objs: Sequence[Any], attr: str) -> I64:
    return np.fromiter(map(attrgetter(attr), objs), np.int64, len(objs))


def _flat(objs: Sequence[Any], attr: str) -> tuple[I64, I64]:
    """(owner index, item) pairs of the tuples ``obj.attr`` of every object."""
    lists = list(map(attrgetter(attr), objs))
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    items = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lens.sum()))
    return np.repeat(np.arange(len(lists), dtype=np.int64), lens), items


def _extract(graph: g.Graph) -> GraphArrays:
    values, ops, bops, cuts = graph.values, graph.ops, graph.backward_ops, graph.cut_points
    n_ops, n_events = len(ops), len(ops) + len(bops)
    nbytes, birth, producer = _ints(values, "nbytes"), _ints(values, "birth"), _ints(values, "producer")
    death = np.fromiter((NO_DEATH if d is None else d for d in map(attrgetter("death"), values)),
                        np.int64, len(values))
    death_unsaved = np.minimum(death, np.fromiter(
        (NO_DEATH if d is None else d for d in map(attrgetter("death_unsaved"), values)),
        np.int64, len(values)))
    activation = np.fromiter((k == g.ACTIVATION for k in map(attrgetter("kind"), values)),
                             np.bool_, len(values))
    last_fwd_use = np.full(len(values), -1, dtype=np.int64)
    for attr in ("inputs", "mutated"):
        op_i, vid = _flat(ops, attr)
        np.maximum.at(last_fwd_use, vid, op_i)
    by_target: dict[str, bool] = {}
    for t in dict.fromkeys(map(attrgetter("target"), ops)):
        by_target[t] = is_expensive(t)
    expensive = np.fromiter(map(by_target.__getitem__, map(attrgetter("target"), ops)),
                            np.bool_, n_ops)
    out_op, out_vid = _flat(ops, "outputs")
    has_outputs = np.bincount(out_op, minlength=n_ops) > 0
    # Graph.live_bytes_timeline, vectorised: bytes live at each event after its outputs exist.
    pre = birth < 0
    born = np.zeros(n_events + 1, dtype=np.int64)
    np.add.at(born, birth[~pre], nbytes[~pre])
    died = np.zeros(n_events + 1, dtype=np.int64)
    dead = death != NO_DEATH
    np.add.at(died, death[dead], nbytes[dead])
    cum_died = np.concatenate(([0], np.cumsum(died[: n_events - 1]))) if n_events else died[:0]
    timeline = int(nbytes[pre].sum()) + np.cumsum(born[:n_events]) - cum_died
    fwd_flops, bwd_flops = _ints(ops, "fwd_flops"), _ints(ops, "bwd_flops")
    resident, resident_end, cut_i, live, held_i, held = _resident(graph, death)
    # Clean cuts (``clean_cuts``) by what restarting the forward there reads: values only
    # held across a cut (``liveness.held_past_cuts``) count in its bytes, not in its live set.
    read_i, read = _flat(cuts, "live")
    keep = ~resident[read]
    dying = resident[read] & (resident_end[read] != NO_DEATH)
    min_prod = np.full(len(cuts), n_ops, dtype=np.int64)
    np.minimum.at(min_prod, read_i[keep], producer[read[keep]])
    cut_bytes = np.zeros(len(cuts), dtype=np.int64)
    np.add.at(cut_bytes, cut_i, nbytes[live])
    return GraphArrays(
        fingerprint=graph.fingerprint, n_ops=n_ops, nbytes=nbytes, birth=birth, death=death,
        death_unsaved=death_unsaved,
        producer=producer, activation=activation, last_fwd_use=last_fwd_use,
        fwd_flops=fwd_flops, bwd_flops=bwd_flops, expensive=expensive, has_outputs=has_outputs,
        out_op=out_op, out_vid=out_vid, grad_of=_ints(bops, "grad_of"), timeline=timeline,
        died=died, born0=int(born[0]), base_bytes=int(nbytes[pre].sum()),
        step_flops=int(fwd_flops.sum()) + int(_ints(bops, "fwd_flops").sum()),
        cut_after=_ints(cuts, "after"), cut_bytes=cut_bytes, cut_min_producer=min_prod,
        cut_of=cut_i, cut_live=live, held_of=held_i, held_vid=held, res_of=read_i[dying],
        res_vid=read[dying], resident=resident, resident_end=resident_end,
    )


def _resident(graph: g.Graph, death: I64
              ) -> tuple[npt.NDArray[np.bool_], I64, I64, I64, I64, I64]:
    """Which values are resident rather than a stage's bytes, until which forward op, the
    cut live sets the chain uses, (cut index, value) pairs, and of those the pairs of values
    only held there (past their last read).

    Resident: shared values (``liveness.shared_values``), skips (``liveness.skip_values``: a
    U-Net's encoder outputs), values the user's code holds past their last read across two or
    more call cuts (``liveness.held_past_cuts``: a KV cache, a list of hidden states), and
    values live across two or more cuts that autograd never saves (the user's code alone
    decides when they die). They are counted like parameters from their creation (until they
    die in the forward, for those never saved) and never decide where a boundary may go: no
    plan shortens their lives by much (a region could drop a saved one it makes: counting it
    is conservative). A region's tape lengthens the lives of those dying in the forward: the
    checkpoints of the chosen cuts they are read across count them (``_cut_sets``). Other
    values held past their last read are live across the cuts they are held across (a region
    ending there keeps them)."""
    values, ops, cuts = graph.values, graph.ops, graph.cut_points
    n_ops, nv = len(ops), len(values)
    held = held_past_cuts(values, ops, [c.after for c in cuts])
    resident = np.zeros(nv, dtype=np.bool_)
    shared = sorted(shared_values(values, ops, graph.module_calls))
    resident[shared] = True
    resident[sorted(skip_values(values, ops, graph.module_calls))] = True
    resident[[v for v, (a, b) in held.items()
              if _held_long(cuts, a, b, int(graph.values[v].death_unsaved or n_ops))]] = True
    saved_or_shared = death >= n_ops
    saved_or_shared[shared] = True
    resident_end = np.where(saved_or_shared, NO_DEATH, death)
    cut_i, live = _flat(cuts, "live")
    spans = [(v, a, b) for v, (a, b) in held.items() if not resident[v]]
    held_i = held_v = np.zeros(0, dtype=np.int64)
    if spans:
        held_i = np.concatenate([np.arange(a, b + 1) for _, a, b in spans])
        held_v = np.concatenate([np.full(b - a + 1, v) for v, a, b in spans])
        cut_i, live = np.concatenate((cut_i, held_i)), np.concatenate((live, held_v))
        only = ~np.isin(held_i * nv + held_v, cut_i[: len(cut_i) - len(held_i)] * nv
                        + live[: len(live) - len(held_v)])  # (a returned value is both)
        held_i, held_v = held_i[only], held_v[only]
    pairs = np.unique(cut_i * nv + live)  # once each (outputs are both)
    cut_i, live = pairs // nv, pairs % nv
    crossings = np.bincount(live, minlength=nv)
    resident |= (crossings >= 2) & (death < n_ops)
    keep, keep_held = ~resident[live], ~resident[held_v]
    return resident, resident_end, cut_i[keep], live[keep], held_i[keep_held], held_v[keep_held]


def _held_long(cuts: tuple[g.CutPoint, ...], first: int, last: int, death: int) -> bool:
    """Held across two or more call cuts at the outermost depth among those it crosses (and
    the call end it dies at): a KV cache or a list of hidden states across layers. Not an
    LSTM's state, held by its caller until the next step returns: across that step's cell
    ends, up to one step end."""
    depths = [c.depth for c in cuts[first:last + 1] if c.kind == g.CALL]
    if not depths:
        return False
    outer = min(depths)
    if last + 1 < len(cuts) and cuts[last + 1].after == death and cuts[last + 1].kind == g.CALL:
        outer = min(outer, cuts[last + 1].depth)
    return depths.count(outer) >= 2


def build_chain(graph: g.Graph, cuts: list[int] | None = None) -> Chain:
    """The chain over the given cut-point indices (default: all clean cuts)."""
    ga = graph_arrays(graph)
    cut_idx = np.array(clean_cuts(graph) if cuts is None else list(cuts), dtype=np.int64)
    st = _stages(ga, cut_idx)
    x, xbar, d, xsac, xsac_b, held, xh, res = _stage_bytes(graph, ga, st, cut_idx)
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


def _stop_flops(graph: g.Graph, ga: GraphArrays, st: _Stages) -> I64:
    """``Chain.fstop``: the FLOPs of the ops after the last one, up to each stage's end, that
    makes an activation an op up to there saves or writes one saved in place (a region
    whose replay would stop before its first op is never replayed: the planner clamps)."""
    made = np.full(ga.n_ops, -1, dtype=np.int64)
    op_i, vid = _flat(graph.ops, "saved")
    mine = ga.activation[vid] & (ga.producer[vid] >= 0)
    np.maximum.at(made, op_i[mine], ga.producer[vid[mine]])
    saved_any = np.zeros(len(graph.values), dtype=np.bool_)
    saved_any[vid] = True
    op_m, vid_m = _flat(graph.ops, "mutated")
    writes = ga.activation[vid_m] & saved_any[vid_m]
    made[op_m[writes]] = op_m[writes]
    stop = np.maximum.accumulate(made) if ga.n_ops else made
    cum = np.concatenate(([0], np.cumsum(ga.fwd_flops)))
    return (cum[st.afters + 1] - cum[stop[st.afters] + 1]).astype(np.int64)


@dataclass(frozen=True)
class _Stages:
    """Which stage each op and each activation belongs to."""

    k: int
    firsts: I64  # first op of each stage
    afters: I64  # last op of each stage (its cut)
    span: int  # ops up to the last cut
    stage_of_op: I64  # ops after the last cut: stage 0
    made: npt.NDArray[np.bool_]  # values made by a forward op (activations)
    v_stage: I64  # the stage that made each value (0 for others)
    retained: npt.NDArray[np.bool_]  # kept for backward (or alive after the step)


def _stages(ga: GraphArrays, cut_idx: I64) -> _Stages:
    afters = ga.cut_after[cut_idx]
    k = len(afters)
    firsts = np.concatenate(([0], afters[:-1] + 1))
    stage_of_op = np.zeros(ga.n_ops, dtype=np.int64)
    span = int(afters[-1]) + 1
    stage_of_op[:span] = np.repeat(np.arange(k), afters - firsts + 1)
    made = ga.activation & (ga.producer >= 0)
    v_stage = stage_of_op[np.where(made, ga.producer, 0)]
    return _Stages(k, firsts, afters, span, stage_of_op, made, v_stage, ga.death >= ga.n_ops)


def _stage_bytes(graph: g.Graph, ga: GraphArrays, st: _Stages, cut_idx: I64
                 ) -> tuple[I64, I64, I64, I64, I64, I64, I64, I64]:
    """x (a checkpoint's bytes), xbar (what a plain run keeps), d (the part of x nobody
    saves), xsac and xsac_b (what a drop-cheap stage keeps, and holds at its backward), and
    per cut: the unsaved bytes only held there, the saved ones (``Chain.xh``), and the
    resident bytes counted in x (``_cut_sets``)."""
    nbytes, nv, k, retained = ga.nbytes, len(ga.nbytes), st.k, st.retained
    own = st.made & ~ga.resident  # resident values are no stage's bytes
    kept = _exact_sum(st.v_stage, nbytes, own & retained, k)
    pairs, held, res = _cut_sets(ga, cut_idx, k)
    cut_of, live = pairs // nv, pairs % nv
    h_of, h_vid = held // nv, held % nv
    held_free = _exact_sum(h_of, nbytes[h_vid], ~retained[h_vid], k)
    held_saved = _exact_sum(h_of, nbytes[h_vid], retained[h_vid], k)
    x = ga.cut_bytes[cut_idx] - held_free - held_saved + res
    x_kept = _exact_sum(cut_of, nbytes[live], retained[live], k)
    exp = ga.expensive[ga.out_op] & ~ga.resident[ga.out_vid]
    ex_pairs = np.unique(st.stage_of_op[ga.out_op[exp]] * nv + ga.out_vid[exp])
    ex_pairs = ex_pairs[~np.isin(ex_pairs, pairs)]
    ex_stage, ex_vid = ex_pairs // nv, ex_pairs % nv
    exp_kept = _exact_sum(ex_stage, nbytes[ex_vid], retained[ex_vid], k)
    not_kept_exp = _exact_sum(ex_stage, nbytes[ex_vid], ~retained[ex_vid], k)
    d = x - x_kept
    return (x, kept + d, d, x + exp_kept + not_kept_exp, kept + d + not_kept_exp, held_free,
            held_saved, res)


def _cut_sets(ga: GraphArrays, cut_idx: I64, k: int) -> tuple[I64, I64, I64]:
    """What each chosen cut carries, as stage * n_values + value keys: the values counted in
    its checkpoint (read across it: a scope starting there keeps them on its tape, see
    ``evaluate``), the values only held there (the user's code refers to them past their last
    read; they die in the forward, so no tape keeps them), and the bytes of the resident
    values read across it that die in the forward (an LSTM's hidden state, a GNN layer's
    input read by two ops of the next layers: a tape reading one keeps it until its backward,
    like any input). Read across several chosen cuts, such a value counts in each of their
    checkpoints: a region starting at any of them may keep it, and regions at two of them
    count it twice (conservative: the evaluator's tapes share one copy). A saved value held
    across two or more chosen cuts counts in their checkpoints, as before (conservative)."""
    nv = len(ga.nbytes)
    position = np.full(len(ga.cut_after), -1, dtype=np.int64)
    position[cut_idx] = np.arange(k)
    chosen = position[ga.cut_of] >= 0
    both = np.unique(position[ga.cut_of[chosen]] * nv + ga.cut_live[chosen])
    on = position[ga.held_of] >= 0
    held = np.unique(position[ga.held_of[on]] * nv + ga.held_vid[on])
    h_vid = held % nv
    saved = ga.death[h_vid] >= ga.n_ops
    held = held[~saved | (np.bincount(h_vid, minlength=nv)[h_vid] == 1)]
    pairs = both[~np.isin(both, held)]
    on = position[ga.res_of] >= 0
    res = _exact_sum(position[ga.res_of[on]], ga.nbytes[ga.res_vid[on]],
                     np.ones(int(on.sum()), dtype=np.bool_), k)
    return pairs, held, res


def _stage_flops(ga: GraphArrays, st: _Stages
                 ) -> tuple[I64, I64, I64, tuple[tuple[int, ...], ...]]:
    """Forward and backward FLOPs per stage, the FLOPs drop-cheap recomputes, and its ops."""
    k, stage_of_op = st.k, st.stage_of_op
    ops_all = np.ones(ga.n_ops, dtype=np.bool_)
    f = _exact_sum(stage_of_op, ga.fwd_flops, ops_all, k)
    b = _exact_sum(stage_of_op, ga.bwd_flops, ops_all, k)
    cheap_mask = ~ga.expensive & ga.has_outputs
    fcheap = _exact_sum(stage_of_op, ga.fwd_flops, cheap_mask, k)
    cheap_idx = np.nonzero(cheap_mask)[0]
    cheap_stage = stage_of_op[cheap_idx]
    order = np.argsort(cheap_stage, kind="stable")
    bounds = np.cumsum(np.bincount(cheap_stage, minlength=k))[:-1]
    cheap = tuple(tuple(p.tolist()) for p in np.split(cheap_idx[order], bounds))
    return f, b, fcheap, cheap


def _forward_transients(ga: GraphArrays, st: _Stages, held: I64, res_read: I64
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


def _backward_transients(ga: GraphArrays, st: _Stages, xbar: I64, d: I64) -> tuple[I64, I64]:
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


def _exact_sum(group: I64, vals: I64, mask: npt.NDArray[np.bool_], k: int) -> I64:
    """Per-group int64 sums of ``vals`` where ``mask`` (np.add.at: exact, unlike bincount)."""
    out = np.zeros(k, dtype=np.int64)
    np.add.at(out, group[mask], vals[mask])
    return out
