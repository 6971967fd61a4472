"""``sqrt``: sqrt(n) segments balanced by bytes; each but the last recomputed once (Alg. 1)."""

from __future__ import annotations

import math

from memplan.core.plan import Plan
from memplan.core.planners.common import ChainLike, as_chain, finish, segmented, segments_by_weight


def plan_sqrt(graph: ChainLike, budget_bytes: int | None = None,
              segments: int | None = None) -> Plan:
    chain = as_chain(graph)
    n = segments if segments is not None else max(1, math.isqrt(chain.n - 1) + 1)
    segs = segments_by_weight([int(v) for v in chain.xbar], n)
    return finish(chain, segmented(segs), "sqrt", {"segments": len(segs)}, budget_bytes)
