"""Planners: pure deterministic functions (graph or chain, budget_bytes, **params) -> Plan."""

from __future__ import annotations

from collections.abc import Callable

from memplan.core.plan import Plan
from memplan.core.planners.chen import plan_chen, plan_chen_greedy
from memplan.core.planners.drop_cheap import plan_drop_cheap
from memplan.core.planners.ilp import plan_ilp
from memplan.core.planners.optimal import plan_optimal
from memplan.core.planners.pareto import pareto
from memplan.core.planners.recursive import plan_recursive
from memplan.core.planners.sqrt import plan_sqrt

PLANNERS: dict[str, Callable[..., Plan]] = {
    "sqrt": plan_sqrt,
    "chen-greedy": plan_chen_greedy,
    "chen": plan_chen,
    "drop-cheap": plan_drop_cheap,
    "recursive": plan_recursive,
    "optimal": plan_optimal,
    "ilp": plan_ilp,
}

__all__ = ["PLANNERS", "pareto", "plan_chen", "plan_chen_greedy", "plan_drop_cheap", "plan_ilp",
           "plan_optimal", "plan_recursive", "plan_sqrt"]
