"""Lower bounds on recomputation, with which the optimal planner drops frontier points that
no optimal plan can use (``frontier.fill``'s cost caps). They never change the optimum.

Every stage runs forward once; a stage the top level does not keep (keep or drop-cheap) lies
in a recompute region and runs at least twice. Top-level stages hold bytes until their
backward (``chain._run``): keep s adds xbar_s - d_{s-1}, drop-cheap s adds xsac_s, regions
add their checkpoints (>= 0, left out here). At the last top-level stage q of a prefix, what
the stages before it hold plus q's own need must fit the free bytes. So the FLOPs the top level
saves form a multiple-choice knapsack (per stage: region, keep or drop-cheap); the greedy over
each stage's upper hull solves its LP relaxation (Sinha & Zoltners 1979), an upper bound on
the saving: a lower bound on the recomputation, of the whole chain and of each prefix.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memplan.core.jit import jit
from memplan.core.planners.frontier import CHEAP, COST, DC_NEED, DPREV, NEED_B, TF_TOP, XBAR, XSAC

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


@jit
def _hull(w: F64, p: F64) -> tuple[float, float, F64, F64]:
    """A stage's options (w[i], p[i]) plus 'neither' (0, 0): the free start (the most profit
    at weight <= 0) and the increments along the upper hull beyond it (<= 2)."""
    w0, p0 = 0.0, 0.0
    for i in range(w.shape[0]):
        if w[i] <= 0 and (p[i] > p0 or (p[i] == p0 and w[i] < w0)):
            w0, p0 = w[i], p[i]
    pts_w, pts_p = np.empty(w.shape[0] + 1), np.empty(w.shape[0] + 1)
    pts_w[0], pts_p[0] = w0, p0
    n = 1
    for i in np.argsort(w):
        if w[i] <= w0 or p[i] <= pts_p[n - 1]:
            continue  # no heavier option pays less: the hull rises
        while n >= 2 and ((pts_p[n - 1] - pts_p[n - 2]) * (w[i] - pts_w[n - 2])
                          <= (p[i] - pts_p[n - 2]) * (pts_w[n - 1] - pts_w[n - 2])):
            n -= 1
        pts_w[n], pts_p[n] = w[i], p[i]
        n += 1
    return w0, p0, np.diff(pts_w[:n]), np.diff(pts_p[:n])


@jit
def _prefix_savings(w_opt: F64, p_opt: F64, need: I64, free: int) -> F64:
    """val[q]: an upper bound on the saving of a prefix whose last top-level stage is q."""
    k = w_opt.shape[0]
    base_w, base_p = np.zeros(k + 1), np.zeros(k + 1)
    inc_stage = np.empty(2 * k, np.int64)
    inc_w, inc_p = np.empty(2 * k), np.empty(2 * k)
    n = 0
    for q in range(k):
        w0, p0, dw, dp = _hull(w_opt[q], p_opt[q])
        base_w[q + 1], base_p[q + 1] = base_w[q] + w0, base_p[q] + p0
        for i in range(dw.shape[0]):
            inc_stage[n], inc_w[n], inc_p[n] = q, dw[i], dp[i]
            n += 1
    # By efficiency, ties by stage: deterministic.
    order = np.argsort(inc_stage[:n], kind="mergesort")
    order = order[np.argsort(-inc_p[order] / inc_w[order], kind="mergesort")]
    val = np.full(k, -np.inf)
    for q in range(k):
        room = free - need[q] - base_w[q]
        if room < 0:
            continue
        saving = base_p[q] + p_opt[q].max()
        for i in order:
            if inc_stage[i] >= q:
                continue
            if inc_w[i] > room:
                saving += inc_p[i] * room / inc_w[i]
                break
            room -= inc_w[i]
            saving += inc_p[i]
        val[q] = saving
    return val


def recompute_bounds(st: I64, free: int, allow_dc: bool) -> tuple[float, F64]:
    """(least recomputation of the whole chain, least recomputation of each prefix 0..s-1 for
    s < K), in cost units, with ``free`` bytes (units) above the base."""
    k = st.shape[1]
    cost = st[COST].astype(np.float64)
    keep_w = (st[XBAR] - st[DPREV]).astype(np.float64)
    keep_need = np.maximum(st[TF_TOP], st[NEED_B] - st[DPREV])
    if allow_dc:
        w_opt = np.stack([keep_w, st[XSAC].astype(np.float64)], axis=1)
        p_opt = np.stack([cost, cost - st[CHEAP]], axis=1)
        need = np.minimum(keep_need, st[DC_NEED])
    else:
        w_opt, p_opt, need = keep_w[:, None], cost[:, None], keep_need
    val = _prefix_savings(np.ascontiguousarray(w_opt), np.ascontiguousarray(p_opt),
                          need.astype(np.int64), int(free))
    run = np.maximum.accumulate(np.concatenate(([0.0], np.maximum(val, 0.0))))  # over q < s
    fpre = np.concatenate(([0.0], np.cumsum(cost)))
    # The last stage is always at the top level (regions never end the chain).
    best = float(cost[k - 1] + run[k - 1])
    if np.isfinite(val[k - 1]):
        best = min(best, float(val[k - 1]))
    return float(fpre[k] - best), fpre[:k] - run[:k]
