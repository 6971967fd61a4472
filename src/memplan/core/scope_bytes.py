"""Bytes a recompute scope (a region, or a drop-cheap stage) holds that the plain run does not,
per stage, under the runtime's semantics (``memplan.core.evaluate``'s docstring): what
``chain.Chain`` adds to its checkpoints so that a plan's predicted peak is never below its
evaluated one. Found by comparing every schedule of the stored test graphs with ``evaluate``
(``tests/core/test_chain_vs_evaluate.py``):

* ``tape_copy``: a scope's tape copies an outside tensor its ops write in place (BatchNorm's
  ``num_batches_tracked += 1``) and keeps the copy until its backward; a replay copies it
  again while the op runs.
* ``tape_kept``: a scope's tape keeps the shared values its ops read (``resident``: a rotary
  table every layer reads) until its backward, where the plain run frees them at the end of
  the forward (counted per stage: a value read by several stages of one region counts once
  per stage, conservatively).
* ``held_twice``: a value a stage saves itself that the user's code still holds when backward
  starts (a model's output): the replay makes it again beside the original
  (``held_twice_cheap``: those a drop-cheap replay makes, cheap ops' outputs).
* ``dc_held``: a drop-cheap stage's expensive outputs nobody saves, read across its cut (a
  language model's logits): its tape keeps them until it replays, where the plain run frees
  them once the next stage has read them (the chain's credit d).
* ``tape_read``: a region's tape keeps what its first stage saves of the values made before it
  until the region's backward ends, where autograd releases each after its op's backward: the
  rise of the stage's backward peak when they live to its end (a chain's backward segments).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memplan.core.checkpoints import cut_sets
from memplan.core.graph_arrays import NO_DEATH, GraphArrays
from memplan.core.stages import Stages, exact_sum

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ScopeBytes:
    tape_copy: I64
    tape_kept: I64
    held_twice: I64
    held_twice_cheap: I64
    dc_held: I64
    tape_ext: I64  # per event: bytes the tapes keep beyond autograd (``tape_read``)


def scope_bytes(ga: GraphArrays, st: Stages, cut_idx: I64, seg_end: I64) -> ScopeBytes:
    """The per-stage bytes above; ``seg_end``: per stage, the last event of its backward
    segment (-1 when it has none)."""
    k, nv, n_ops, in_stage = st.k, len(ga.nbytes), ga.n_ops, st.stage_of_op
    op_in, vid_in, op_m, vid_m = ga.in_op, ga.in_vid, ga.mut_op, ga.mut_vid
    # Copies (``scopes.PlanScopes.tape_reads``): values an op reads and writes, made outside
    # its stage; a batch norm's buffers never (it writes its running statistics only).
    read_written = np.isin(op_m * nv + vid_m, op_in * nv + vid_in) & (op_m < st.span)
    made_here = (ga.producer[vid_m] >= 0) & (
        in_stage[np.maximum(ga.producer[vid_m], 0)] == in_stage[op_m])
    copied = read_written & ~(ga.state[vid_m] & ga.batch_norm[op_m]) & ~made_here
    tape_copy = exact_sum(in_stage[op_m], ga.nbytes[vid_m], copied, k)
    # Resident values made before a stage, read by it, dying in the forward, that the chain
    # counts as never dying (shared ones): the others count in the checkpoints of the cuts
    # they are read across (``checkpoints.cut_sets``), the region's input among them.
    kept = (op_in < st.span) & ga.resident[vid_in] & ga.activation[vid_in] & (
        ga.producer[vid_in] >= 0) & (ga.death[vid_in] < n_ops)
    kept &= ga.resident_end[vid_in] == NO_DEATH
    kept &= ga.producer[vid_in] < st.firsts[in_stage[op_in]]
    keys = np.unique(in_stage[op_in[kept]] * nv + vid_in[kept])
    tape_kept = exact_sum(keys // nv, ga.nbytes[keys % nv], np.ones(len(keys), np.bool_), k)
    # Saves: (op, value) pairs within the stages.
    op_s, vid_s = ga.save_op, ga.save_vid
    act = ga.activation[vid_s] & (ga.producer[vid_s] >= 0) & (op_s < st.span)
    prod_stage = in_stage[np.maximum(ga.producer[vid_s], 0)]
    own = act & (prod_stage == in_stage[op_s])
    twice = np.zeros(nv, dtype=np.bool_)
    twice[vid_s[own]] = True
    twice &= ga.death_unsaved >= n_ops
    cheap = twice & ~ga.expensive[np.maximum(ga.producer, 0)]
    held_twice = exact_sum(st.v_stage, ga.nbytes, twice, k)
    held_twice_cheap = exact_sum(st.v_stage, ga.nbytes, cheap, k)
    # Expensive outputs in a cut's checkpoint that nobody saves (part of d).
    pairs, _, _ = cut_sets(ga, cut_idx, k)
    cut_of, live = pairs // nv, pairs % nv
    exp_made = ga.activation[live] & (ga.producer[live] >= 0) & ~st.retained[live]
    exp_made &= ga.expensive[np.maximum(ga.producer[live], 0)] & (st.v_stage[live] == cut_of)
    dc_held = exact_sum(cut_of, ga.nbytes[live], exp_made, k)
    # Values made before a stage that it saves, kept to the end of its backward segment.
    before = act & (ga.producer[vid_s] < st.firsts[in_stage[op_s]]) & ~ga.resident[vid_s]
    keys = np.unique(in_stage[op_s[before]] * nv + vid_s[before])
    s_of, v_of = keys // nv, keys % nv
    death = ga.death[v_of]
    end = seg_end[s_of]
    longer = (death < end) & (death >= n_ops)
    ext = np.zeros(len(ga.timeline) + 1, dtype=np.int64)
    np.add.at(ext, death[longer] + 1, ga.nbytes[v_of[longer]])
    np.subtract.at(ext, end[longer] + 1, ga.nbytes[v_of[longer]])
    return ScopeBytes(tape_copy, tape_kept, held_twice, held_twice_cheap, dc_held,
                      np.cumsum(ext)[: len(ga.timeline)])
