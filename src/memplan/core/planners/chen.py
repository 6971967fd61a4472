"""``chen-greedy``: Alg. 3 with a per-segment budget B; ``chen``: Alg. 3 plus the Appendix A
grid search over B (B = sqrt(x y) from the B = 0 run, 6 points on [B/sqrt 2, sqrt 2 B]),
choosing the least extra compute whose peak fits (the paper chose on memory alone)."""

from __future__ import annotations

import math

from memplan.core import chain as C
from memplan.core.budget import budget_too_small
from memplan.core.plan import Plan
from memplan.core.planners.common import ChainLike, as_chain, finish, segmented


def greedy(chain: C.Chain, segment_bytes: float) -> tuple[list[tuple[int, int]], int, int]:
    """Alg. 3: close a segment at the first cut where its running size exceeds B.
    Returns (segments, x: bytes of inter-stage checkpoints, y: largest segment)."""
    segs: list[tuple[int, int]] = []
    temp, x, y, lo = 0, 0, 0, 0
    for s in range(chain.n - 1):
        temp += int(chain.xbar[s])
        if temp > segment_bytes:
            x += int(chain.x[s])
            y = max(y, temp)
            segs.append((lo, s))
            lo, temp = s + 1, 0
    segs.append((lo, chain.n - 1))
    return segs, x, max(y, temp)


def plan_chen_greedy(graph: ChainLike, budget_bytes: int | None = None,
                     segment_bytes: float = 0.0) -> Plan:
    chain = as_chain(graph)
    segs, _, _ = greedy(chain, segment_bytes)
    return finish(chain, segmented(segs), "chen-greedy", {"segment_bytes": segment_bytes},
                  budget_bytes)


def plan_chen(graph: ChainLike, budget_bytes: int | None = None, grid: int = 6) -> Plan:
    chain = as_chain(graph)
    _, x, y = greedy(chain, 0.0)
    b0 = math.sqrt(max(x, 1) * max(y, 1))
    grid_b = [b0 / math.sqrt(2) * 2 ** (i / max(grid - 1, 1)) for i in range(grid)]
    best: tuple[int, int, float] | None = None  # (extra, peak, B)
    least = None
    for b in [0.0, *grid_b]:
        segs, _, _ = greedy(chain, b)
        plan = finish(chain, segmented(segs), "chen", {}, None)
        least = plan.peak_bytes if least is None else min(least, plan.peak_bytes)
        if budget_bytes is None or plan.peak_bytes <= budget_bytes:
            key = (plan.extra_flops, plan.peak_bytes, b) if budget_bytes is not None else (
                plan.peak_bytes, plan.extra_flops, b)
            if best is None or key < best:
                best = key
    if best is None:
        raise budget_too_small(int(budget_bytes or 0), int(least or 0), "chen")
    b = best[2]
    segs, _, _ = greedy(chain, b)
    return finish(chain, segmented(segs), "chen", {"segment_bytes": b, "grid": grid},
                  budget_bytes)
