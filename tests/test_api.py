"""The public API is a contract (changing it must change this test), and the front doors of
``memplan.api``: a Workload, a model and its inputs, or a Graph."""

from __future__ import annotations

import pytest

import memplan
from memplan import api as planning
from memplan.errors import BudgetTooSmall
from tests.builders import unet_inputs, unet_loss
from tests.core.graphs import tiny

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


def test_public_names_resolve_lazily() -> None:
    assert sorted(memplan.__all__) == sorted(memplan._EXPORTS)


def test_the_error_tree() -> None:
    from memplan import errors

    leaves = (errors.ConfigError, errors.CaptureError, errors.BudgetTooSmall, errors.PlanInvalid,
              errors.PlanMismatch, errors.ReplayError)
    assert all(issubclass(e, errors.MemplanError) for e in leaves)
    assert issubclass(errors.ConfigError, ValueError)
    for e in leaves:  # each kind tells itself apart
        assert [o for o in leaves if issubclass(e, o)] == [e]


def test_plan_entry_point() -> None:
    g = tiny("gpt")  # tiny models are parameter-bound: the least peak is 0.88 of plain
    plan = planning.plan(g, budget=0.95)
    assert plan.peak_bytes <= g.peak_bytes * 0.95 and plan.planner == "optimal"
    assert planning.plan(g, budget=0.95, planner="sqrt").planner == "sqrt"
    with pytest.raises(BudgetTooSmall):
        planning.plan(g, budget=1000)
    with pytest.raises(memplan.MemplanError, match="Graph cannot be run"):
        planning.plan(g, budget=0.95, objective="time")  # times are measured on a model
    with pytest.raises(memplan.ConfigError, match="planner"):
        planning.plan(g, budget=0.95, planner="nope")


def test_plan_entry_point_gives_ilp_the_graph() -> None:
    model, x = unet_inputs()
    plan = planning.plan(model, x, loss_fn=unet_loss, budget=0.8, planner="ilp")
    # Given the Graph, ilp planned through every cut point (and may return the DP's plan on
    # the clean chain when it is better: its notes say which).
    n_cuts = len(tiny("unet").cut_points)
    assert plan.planner == "ilp" and any(f"chain of {n_cuts} stages through all cut points" in n
                                         for n in plan.notes)
    assert plan.peak_bytes <= int(0.8 * tiny("unet").peak_bytes)
    assert plan.forward is not None


def test_front_doors_name_what_they_take() -> None:
    with pytest.raises(memplan.ConfigError, match="model: expected a memplan Graph, a Workload"):
        memplan.feature_map_bytes("resnet")
    with pytest.raises(memplan.ConfigError, match="nothing beside a captured Graph"):
        memplan.plan(tiny("gpt"), 1, budget=0.95)
    graph = tiny("resnet")
    assert memplan.feature_map_bytes(graph, plan="sqrt") == memplan.plan_memory(
        graph, plan="sqrt").total_bytes
