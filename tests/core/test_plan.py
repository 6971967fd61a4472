"""Plan JSON, budgets, explain."""

from __future__ import annotations

import json

import pytest

from memplan.core import chain as C
from memplan.core.budget import budget_too_small, parse_budget
from memplan.core.plan import Plan
from memplan.core.planners import PLANNERS
from memplan.errors import BudgetTooSmall, ConfigError, MemplanError
from tests.core.graphs import tiny


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * 2**30), ("7GB", 7 * 10**9), ("512MiB", 512 * 2**20), ("4.5 GB", 4_500_000_000),
    ("100", 100), ("1kb", 1000), (12345, 12345),
])
def test_parse_budget(text: object, expected: int) -> None:
    assert parse_budget(text) == expected


def test_parse_fraction() -> None:
    assert parse_budget(0.25, 1000) == 250
    assert parse_budget(1.0, 1000) == 1000


@pytest.mark.parametrize("bad", ["6 parsecs", "", "GiB", -5, 0, 1.5, 0.0, True, None, [1], "-1GB"])
def test_bad_budget(bad: object) -> None:
    with pytest.raises(ConfigError, match="budget"):
        parse_budget(bad, 1000)


def test_budget_too_small_message() -> None:
    err = budget_too_small(100, 12345, "optimal")
    assert isinstance(err, BudgetTooSmall) and isinstance(err, MemplanError)
    assert "12,345 B" in str(err) and err.least_peak_bytes == 12345


def test_json_round_trip_and_schema() -> None:
    chain = C.build_chain(tiny("resnet"))
    plan = PLANNERS["recursive"](chain, None)
    data = json.loads(plan.to_json())
    assert data["schema_version"] == 1 and data["kind"] == "memplan.Plan"
    assert Plan.from_json(plan.to_json()) == plan
    assert any(s["mirror"] >= 2 for s in data["stages"])  # nesting is recorded
    data["schema_version"] = 99
    with pytest.raises(MemplanError, match="schema_version"):
        Plan.from_dict(data)


def test_explain_names_kept_and_recomputed() -> None:
    chain = C.build_chain(tiny("lstm"))
    least = PLANNERS["optimal"](chain, None)
    text = PLANNERS["optimal"](chain, (least.peak_bytes + least.plain_peak_bytes) // 2).explain()
    assert "recompute" in text and "keep" in text and "FLOPs" in text
