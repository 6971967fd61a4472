"""memplan: train deep nets in sublinear memory (Chen et al. 2016), with exact gradients."""

from __future__ import annotations

from memplan import models
from memplan.capture import capture
from memplan.errors import ConfigError, MemplanError
from memplan.graph import Graph
from memplan.measure import measure
from memplan.report import MemoryReport

__all__ = [
    "ConfigError",
    "Graph",
    "MemoryReport",
    "MemplanError",
    "capture",
    "measure",
    "models",
]
__version__ = "0.1.0"
