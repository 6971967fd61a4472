"""``pareto``: the frontier of (peak bytes, extra FLOPs) over budgets, from the optimal planner."""

from __future__ import annotations

from memplan.core.plan import Plan
from memplan.core.planners.common import ChainLike, as_chain, int_param
from memplan.core.planners.optimal import plan_optimal
from memplan.errors import BudgetTooSmall


def pareto(graph: ChainLike, points: int = 12, **optimal_params: object) -> list[Plan]:
    """Plans for ``points`` budgets spaced geometrically from the least feasible peak to the
    plain peak; only those no other plan beats on both peak and extra FLOPs, by peak."""
    chain = as_chain(graph)
    points = int_param("points", points, 2, "Use e.g. points=12.")
    least = plan_optimal(chain, None, **optimal_params)  # type: ignore[arg-type]
    top = least.plain_peak_bytes
    low = least.peak_bytes
    plans = [least]
    for i in range(1, points):
        budget = int(low * (top / low) ** (i / (points - 1)))
        try:
            plans.append(plan_optimal(chain, budget, **optimal_params))  # type: ignore[arg-type]
        except BudgetTooSmall:
            continue
    plans.sort(key=lambda p: (p.peak_bytes, p.extra_flops))
    front: list[Plan] = []
    for p in plans:
        if not front or p.extra_flops < front[-1].extra_flops:
            front.append(p)
    return front
