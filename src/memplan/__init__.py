"""memplan: train deep nets in sublinear memory (Chen et al. 2016), with exact gradients."""

from __future__ import annotations

from memplan import models
from memplan.allocation import feature_map_bytes, plan_memory
from memplan.apply import apply, unapply
from memplan.budget import BudgetTooSmall
from memplan.capture import capture
from memplan.errors import ConfigError, MemplanError
from memplan.graph import Graph
from memplan.measure import measure
from memplan.plan import Plan
from memplan.planners import PLANNERS, pareto
from memplan.planning import plan
from memplan.report import MemoryReport
from memplan.verify import verify

__all__ = [
    "PLANNERS",
    "BudgetTooSmall",
    "ConfigError",
    "Graph",
    "MemoryReport",
    "MemplanError",
    "Plan",
    "apply",
    "capture",
    "feature_map_bytes",
    "measure",
    "models",
    "pareto",
    "plan",
    "plan_memory",
    "unapply",
    "verify",
]
__version__ = "0.1.0"
