"""memplan: train deep nets in sublinear memory (Chen et al. 2016), with exact gradients.

The public names below resolve lazily (PEP 562): ``import memplan`` imports nothing heavy, and
``import memplan.errors`` or ``import memplan.core.planners`` work without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> (module, attribute); the layers are drawn in docs/architecture.md.
_EXPORTS: dict[str, tuple[str, str]] = {
    "PLANNERS": ("memplan.core.planners", "PLANNERS"),
    "BudgetTooSmall": ("memplan.errors", "BudgetTooSmall"),
    "ConfigError": ("memplan.errors", "ConfigError"),
    "Graph": ("memplan.core.graph", "Graph"),
    "MemoryReport": ("memplan.core.report", "MemoryReport"),
    "MemplanError": ("memplan.errors", "MemplanError"),
    "Plan": ("memplan.core.plan", "Plan"),
    "apply": ("memplan.runtime.apply", "apply"),
    "capture": ("memplan.tracing.capture", "capture"),
    "feature_map_bytes": ("memplan.api", "feature_map_bytes"),
    "measure": ("memplan.tracing.measure", "measure"),
    "models": ("memplan.models", ""),
    "pareto": ("memplan.core.planners", "pareto"),
    "plan": ("memplan.api", "plan"),
    "plan_memory": ("memplan.api", "plan_memory"),
    "unapply": ("memplan.runtime.apply", "unapply"),
    "verify": ("memplan.analysis.verify", "verify"),
}

__all__ = [
    "PLANNERS", "BudgetTooSmall", "ConfigError", "Graph", "MemoryReport", "MemplanError", "Plan",
    "apply", "capture", "feature_map_bytes", "measure", "models", "pareto", "plan",
    "plan_memory", "unapply", "verify",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    entry = _EXPORTS.get(name)
    if entry is None:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    module = importlib.import_module(entry[0])
    value = getattr(module, entry[1]) if entry[1] else module
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from memplan import models
    from memplan.analysis.verify import verify
    from memplan.api import feature_map_bytes, plan, plan_memory
    from memplan.core.graph import Graph
    from memplan.core.plan import Plan
    from memplan.core.planners import PLANNERS, pareto
    from memplan.core.report import MemoryReport
    from memplan.errors import BudgetTooSmall, ConfigError, MemplanError
    from memplan.runtime.apply import apply, unapply
    from memplan.tracing.capture import capture
    from memplan.tracing.measure import measure
