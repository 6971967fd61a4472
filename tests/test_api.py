"""The public API is a contract: changing it must change this test."""

from __future__ import annotations

import ast
import pathlib

import memplan

PUBLIC = [
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


def test_public_names_are_pinned() -> None:
    assert sorted(memplan.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert hasattr(memplan, name)


def test_planning_core_never_imports_torch() -> None:
    src = pathlib.Path(memplan.__file__).parent
    core = ["graph.py", "report.py", "errors.py", "plan.py", "budget.py", "chain.py"]
    core += ["allocation.py", "training_graph.py", "mirror_plans.py"]
    core += [f"planners/{p.name}" for p in sorted((src / "planners").glob("*.py"))]
    for name in core:
        tree = ast.parse((src / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("torch") for a in node.names), name
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("torch"), name


def test_every_error_is_a_memplan_error() -> None:
    assert issubclass(memplan.ConfigError, memplan.MemplanError)
