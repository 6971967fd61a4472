"""Which stage of a chain each forward op and activation belongs to, and per-stage sums."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memplan.core.graph_arrays import GraphArrays

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Stages:
    """Which stage each op and each activation belongs to."""

    k: int
    firsts: I64  # first op of each stage
    afters: I64  # last op of each stage (its cut)
    span: int  # ops up to the last cut
    stage_of_op: I64  # ops after the last cut: stage 0
    made: npt.NDArray[np.bool_]  # values made by a forward op (activations)
    v_stage: I64  # the stage that made each value (0 for others)
    retained: npt.NDArray[np.bool_]  # kept for backward (or alive after the step)


def stages(ga: GraphArrays, cut_idx: I64) -> Stages:
    afters = ga.cut_after[cut_idx]
    k = len(afters)
    firsts = np.concatenate(([0], afters[:-1] + 1))
    stage_of_op = np.zeros(ga.n_ops, dtype=np.int64)
    span = int(afters[-1]) + 1
    stage_of_op[:span] = np.repeat(np.arange(k), afters - firsts + 1)
    made = ga.activation & (ga.producer >= 0)
    v_stage = stage_of_op[np.where(made, ga.producer, 0)]
    return Stages(k, firsts, afters, span, stage_of_op, made, v_stage, ga.death >= ga.n_ops)


def exact_sum(group: I64, vals: I64, mask: npt.NDArray[np.bool_], k: int) -> I64:
    """Per-group int64 sums of ``vals`` where ``mask`` (np.add.at: exact, unlike bincount)."""
    out = np.zeros(k, dtype=np.int64)
    np.add.at(out, group[mask], vals[mask])
    return out
