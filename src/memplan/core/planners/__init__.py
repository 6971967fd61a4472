"""Planners: pure deterministic functions (graph or chain, budget_bytes, **params) -> Plan.

``NAMES`` is known without importing the planners; ``PLANNERS`` (name -> function) and the
functions themselves load on first use (PEP 562): the optimal planner's compiled kernels
(numba) need not load for ``memplan --help``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# planner name -> (module, function)
_WHERE = {
    "sqrt": ("sqrt", "plan_sqrt"),
    "chen-greedy": ("chen", "plan_chen_greedy"),
    "chen": ("chen", "plan_chen"),
    "drop-cheap": ("drop_cheap", "plan_drop_cheap"),
    "recursive": ("recursive", "plan_recursive"),
    "optimal": ("optimal", "plan_optimal"),
    "ilp": ("ilp", "plan_ilp"),
}
NAMES = tuple(_WHERE)
_FUNCTIONS = {fn: mod for mod, fn in _WHERE.values()} | {"pareto": "pareto"}

__all__ = ["NAMES", "PLANNERS", "pareto", "plan_chen", "plan_chen_greedy", "plan_drop_cheap",
           "plan_ilp", "plan_optimal", "plan_recursive", "plan_sqrt"]


def __getattr__(name: str) -> Any:
    if name == "PLANNERS":
        value: Any = {n: __getattr__(fn) for n, (_, fn) in _WHERE.items()}
    elif name in _FUNCTIONS:
        value = getattr(importlib.import_module(f"{__name__}.{_FUNCTIONS[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # resolved once
    return value


if TYPE_CHECKING:
    from collections.abc import Callable

    from memplan.core.plan import Plan
    from memplan.core.planners.chen import plan_chen, plan_chen_greedy
    from memplan.core.planners.drop_cheap import plan_drop_cheap
    from memplan.core.planners.ilp import plan_ilp
    from memplan.core.planners.optimal import plan_optimal
    from memplan.core.planners.pareto import pareto
    from memplan.core.planners.recursive import plan_recursive
    from memplan.core.planners.sqrt import plan_sqrt

    PLANNERS: dict[str, Callable[..., Plan]]
