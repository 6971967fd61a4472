"""The optimal planner's budgeted search (Alg. 3's question: the least cost at a budget) over
its program (``program``): costs capped at a lower bound plus a slack (``bounds``), probes
where that bound is far below the optimum, and the proof of a probe's plan, capped by need
where that pays (``priced``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memplan.core.planners import frontier as F
from memplan.core.planners.bounds import recompute_bounds
from memplan.core.planners.program import Program, Shape, least_need

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
SLACK_START = 32  # the first search allows 1/32 of a forward pass above the lower bound
PROBE_TOP = 256  # a probe's top-level slack, in multiples of its bodies' (``search``)
# The proof's slack, in multiples of the probe's, from which it is capped by need
# (``priced``): that costs a forward program over the chain, tenths of a second on 1,000
# stages, and pays where the plain caps keep far more than the bounds allow (LSTM T=1024
# at 0.5 GB: 37 times, proof 1.68 -> 0.75 s); not where they keep little (ResNet-1000 at
# 3.8 GB, 1/32 of a forward pass: 5.5 times, 0.09 s plain, 0.14 s capped by need).
PRICED = 16
REPROBE = 4  # ``_priced_proof``: a probe's plan this many slacks above the root: probe again


def cost_caps(shape: Shape, bounds: tuple[float, F64], slack: int,
              top_slack: int | None = None) -> tuple[I64, int]:
    """Cost caps that keep every plan whose recomputation is within ``slack`` of the lower
    bound (``bounds``: ``recompute_bounds``): the suffix from s pays at most the rest of that
    after the prefix's own least recomputation; a region's body at most the slack beyond one
    replay. ``top_slack``: the suffixes' slack instead (a probe's, larger)."""
    cost = shape.st[F.COST]
    lb_total, lb_prefix = bounds
    margin = 1 + int(1e-9 * float(cost.sum()))  # the bounds are floats
    suffix = np.cumsum(cost[::-1])[::-1]
    top_slack = slack if top_slack is None else top_slack
    top = suffix + np.floor(lb_total - lb_prefix).astype(np.int64) + top_slack + margin
    return np.minimum(top, F.BIG // 4), min(slack + margin, F.BIG // 4)


def search(shape: Shape, free: int, upper: int | None = None) -> Program | None:
    """The program at ``free`` bytes whose root point is the optimum; None: nothing fits.
    Costs are capped at the lower bound plus a slack (the caps never cut a plan within
    them, so the first plan found within them is optimal). When the first two caps cut every
    plan, the bound is far below the optimum (it ignores nesting): probes look for a plan,
    their bodies' slack half the first caps' and doubled while none is found, their top
    level's ``PROBE_TOP`` times larger. Why: a fill's time grows with its bodies' slack far
    faster than with its top level's (LSTM T=1024 at 0.5 GB: bodies 1/64 of a forward pass,
    top 4, 0.08 s, finding the optimum; bodies 1/8, 0.5 s). A plan a probe finds is optimal
    if it lies within the bodies' slack (every plan that does is in the probe), else its cost
    is the slack of one last fill, which keeps it and so finds the optimum; capped by need
    where that slack is ``PRICED`` times the probe's or more (``_priced_proof``).
    ``upper``: the cost of a plan thought to fit; the first slack, and a probe's top-level
    slack, are at most what keeps it (smaller caps, a faster fill); if a fill that keeps it
    finds none, it does not fit and the search goes on without it."""
    k = shape.st.shape[1]
    forward = int(shape.st[F.COST].sum())
    total = forward + int(shape.st[F.CHEAP].sum())
    bounds = recompute_bounds(shape.st, free, shape.allow_dc)
    slack = max(1, forward // SLACK_START)
    # The slack that keeps the upper plan: no optimum costs more, so no probe needs more.
    ceiling = None if upper is None else max(1, upper - forward - int(bounds[0]) + 1)
    if ceiling is not None:
        slack = min(slack, ceiling)
    for caps in (slack, 2 * slack):  # mostly the bound is close: the optimum within these
        prog = shape.fill(free, cost_caps(shape, bounds, caps))
        if prog.point(0, k - 1, 0, free) is not None:
            return prog
        if caps == slack and least_need(shape) > free:
            return None
        if ceiling is not None and caps >= ceiling:
            ceiling = None  # the upper plan does not fit after all
    inner = max(1, slack // 2)
    while True:
        unbounded = inner > (k + 1) * max(total, 1)
        top = PROBE_TOP * inner if ceiling is None else min(PROBE_TOP * inner,
                                                            max(inner, ceiling))
        prog = shape.fill(free, None if unbounded else cost_caps(shape, bounds, inner, top))
        hit = prog.point(0, k - 1, 0, free)
        if hit is not None:
            over = hit[0] - forward - int(bounds[0])  # its recomputation above the bound
            if unbounded or over <= inner:
                return prog
            if over < PRICED * inner:  # the proof: every plan costing at most this one's
                return shape.fill(free, cost_caps(shape, bounds, over))
            return _priced_proof(shape, free, bounds, prog, inner)
        if unbounded:
            return None
        if ceiling is not None and inner >= ceiling:
            ceiling = None  # the upper plan does not fit after all
        inner *= 2


def _priced_proof(shape: Shape, free: int, bounds: tuple[float, F64], probe: Program,
                  inner: int) -> Program:
    """The proof of a probe's plan, capped by need (``priced``). Where that plan lies far
    above the relaxation's root (``REPROBE`` times the probe's bodies' slack), one more
    probe, its slack doubled under those caps, may find a cheaper one, whose caps are
    tighter (ResNet-1000 at its least peak: 0.45 of a forward pass above the bound at 1/64,
    0.25 at 1/32). A probe's plan within its bodies' slack is optimal."""
    k = shape.st.shape[1]
    forward = int(shape.st[F.COST].sum())
    cost = probe.point(0, k - 1, 0, free)[0]  # type: ignore[index]
    relaxed = shape.relax(free, cost)
    if cost - relaxed.root > REPROBE * inner:
        inner *= 2
        again = shape.fill(free, cost_caps(shape, bounds, inner, PROBE_TOP * inner),
                           relaxed.caps(cost))
        hit = again.point(0, k - 1, 0, free)  # at most cost: the first plan is in it
        if hit is not None:
            cost = hit[0]
            if cost - forward - int(bounds[0]) <= inner:
                return again
    over = cost - forward - int(bounds[0])
    return shape.fill(free, cost_caps(shape, bounds, over), relaxed.caps(cost))
