"""``drop-cheap``: Sec. 4.2: keep expensive outputs (conv, matmul), recompute cheap ones (norms,
activations, pointwise), stage by stage with selective checkpoint policies. Converts the
stages that save most bytes per recomputed FLOP first, only as many as the budget needs."""

from __future__ import annotations

from memplan.core import schedule as S
from memplan.core.plan import Plan
from memplan.core.planners.common import ChainLike, as_chain, finish


def plan_drop_cheap(graph: ChainLike, budget_bytes: int | None = None) -> Plan:
    chain = as_chain(graph)
    gain = [int(chain.xbar[s] - chain.xsac[s]) for s in range(chain.n - 1)]
    order = sorted((s for s in range(chain.n - 1) if gain[s] > 0),
                   key=lambda s: (-gain[s] / (int(chain.fcheap[s]) + 1), s))

    def schedule(n_converted: int) -> tuple[S.Item, ...]:
        chosen = set(order[:n_converted])
        return tuple(S.DropCheap(s) if s in chosen else S.Keep(s) for s in range(chain.n))

    lo, hi = 0, len(order)
    if budget_bytes is not None:  # fewest conversions that fit (peak falls as we convert)
        while lo < hi:
            mid = (lo + hi) // 2
            if S.simulate(chain, schedule(mid))[0] <= budget_bytes:
                hi = mid
            else:
                lo = mid + 1
    return finish(chain, schedule(hi), "drop-cheap", {"stages_converted": hi}, budget_bytes)
