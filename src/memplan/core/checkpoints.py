"""Checkpoint accounting: the bytes a chain's stage keeps, carries across its cut and holds
at its backward in each mode (keep, drop-cheap, a region's input: ``chain.Chain``'s x, xbar,
d, xsac, xsac_b), from the cut live sets of ``resident``."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.graph_arrays import GraphArrays
from memplan.core.stages import Stages, exact_sum

I64 = npt.NDArray[np.int64]


def stage_bytes(graph: g.Graph, ga: GraphArrays, st: Stages, cut_idx: I64
                 ) -> tuple[I64, I64, I64, I64, I64, I64, I64, I64]:
    """x (a checkpoint's bytes), xbar (what a plain run keeps), d (the part of x nobody
    saves), xsac and xsac_b (what a drop-cheap stage keeps, and holds at its backward), and
    per cut: the unsaved bytes only held there, the saved ones (``Chain.xh``), and the
    resident bytes counted in x (``cut_sets``)."""
    nbytes, nv, k, retained = ga.nbytes, len(ga.nbytes), st.k, st.retained
    own = st.made & ~ga.resident  # resident values are no stage's bytes
    kept = exact_sum(st.v_stage, nbytes, own & retained, k)
    pairs, held, res = cut_sets(ga, cut_idx, k)
    cut_of, live = pairs // nv, pairs % nv
    h_of, h_vid = held // nv, held % nv
    held_free = exact_sum(h_of, nbytes[h_vid], ~retained[h_vid], k)
    held_saved = exact_sum(h_of, nbytes[h_vid], retained[h_vid], k)
    x = ga.cut_bytes[cut_idx] - held_free - held_saved + res
    x_kept = exact_sum(cut_of, nbytes[live], retained[live], k)
    exp = ga.expensive[ga.out_op] & ~ga.resident[ga.out_vid]
    ex_pairs = np.unique(st.stage_of_op[ga.out_op[exp]] * nv + ga.out_vid[exp])
    ex_pairs = ex_pairs[~np.isin(ex_pairs, pairs)]
    ex_stage, ex_vid = ex_pairs // nv, ex_pairs % nv
    exp_kept = exact_sum(ex_stage, nbytes[ex_vid], retained[ex_vid], k)
    not_kept_exp = exact_sum(ex_stage, nbytes[ex_vid], ~retained[ex_vid], k)
    d = x - x_kept
    return (x, kept + d, d, x + exp_kept + not_kept_exp, kept + d + not_kept_exp, held_free,
            held_saved, res)


def cut_sets(ga: GraphArrays, cut_idx: I64, k: int) -> tuple[I64, I64, I64]:
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
    res = exact_sum(position[ga.res_of[on]], ga.nbytes[ga.res_vid[on]],
                     np.ones(int(on.sum()), dtype=np.bool_), k)
    return pairs, held, res

