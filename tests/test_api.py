"""The public API is a contract: changing it must change this test."""

from __future__ import annotations

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
