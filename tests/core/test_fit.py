"""A budget is a promise (issue 11): every plan ``memplan.plan`` returns has its evaluated
peak (the runtime's semantics on the captured graph) as ``peak_bytes``, never above the
budget; a refusal names the least peak of each planner and the one to use. Shared values,
leaf-module ends and functional-code op boundaries give the chain the cuts it needs."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.core import chain as C
from memplan.core import fit as F
from memplan.core import graph as g
from memplan.core import liveness as L
from memplan.core.budget import format_bytes
from memplan.core.evaluate import evaluate
from memplan.core.floor import peak_floor
from memplan.core.planners import PLANNERS
from memplan.errors import BudgetTooSmall
from tests.core.graphs import tiny

LEAST_PEAKS = F.least_peaks  # the function itself (tests replace it with a cached copy)
GRAPHS = ("resnet", "lstm", "gpt", "unet", "calibration", "rope", "flat", "functional")
CHEAP = ("sqrt", "chen", "drop-cheap", "recursive", "optimal")


@functools.cache
def _least_peaks(name: str) -> dict[str, int]:
    graph = tiny(name)
    return LEAST_PEAKS(graph, C.build_chain(graph), {"node_limit": 20})


def _refusal(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Refusals compare every planner (ilp included): computed once per graph here."""
    monkeypatch.setattr(F, "least_peaks", lambda graph, chain, params, skip="": {
        k: v for k, v in _least_peaks(name).items() if k != skip})


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(GRAPHS), st.sampled_from(CHEAP), st.floats(0.05, 1.0))
def test_every_plan_fits_its_budget_as_evaluated(name: str, planner: str,
                                                 fraction: float) -> None:
    graph = tiny(name)
    budget = int(fraction * graph.peak_bytes)
    with pytest.MonkeyPatch.context() as mp:
        _refusal(mp, name)
        try:
            plan = F.fit(graph, planner, budget, {})
        except BudgetTooSmall as err:
            assert err.least_peak_bytes > budget and err.planner == planner
            assert set(err.least_peaks) == set(F.COMPARED) | {planner}
            assert err.least_peaks[planner] == err.least_peak_bytes
            floor = peak_floor(graph)
            assert err.floor_bytes == floor.floor_bytes <= min(err.least_peaks.values())
            assert ("No plan can fit it" in str(err)) == (budget < floor.floor_bytes)
            return
    assert evaluate(graph, plan).peak_bytes == plan.peak_bytes <= budget
    assert plan.peak_bytes >= peak_floor(graph).floor_bytes
    assert plan.budget_bytes == budget and plan.plain_peak_bytes == graph.peak_bytes


@pytest.mark.parametrize("name", GRAPHS)
def test_least_peak_plans_are_evaluated(name: str) -> None:
    graph = tiny(name)
    plan = F.fit(graph, "optimal", None, {})
    assert plan.peak_bytes == evaluate(graph, plan).peak_bytes < graph.peak_bytes


def test_ilp_keeps_its_budget_too() -> None:
    graph = tiny("unet")
    for fraction in (0.9, 0.7):
        budget = int(fraction * graph.peak_bytes)
        plan = F.fit(graph, "ilp", budget, {"node_limit": 20})
        assert evaluate(graph, plan).peak_bytes == plan.peak_bytes <= budget


def test_refusal_points_to_the_planner_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the U-Net the recursive planner's least peak (Sec. 4.4) is below the dynamic
    program's (its chain model is conservative about the skips): a budget between them is
    refused by 'optimal' with the advice to use 'recursive', and 'ilp' no longer says
    "try optimal" when optimal cannot do better."""
    _refusal(monkeypatch, "unet")
    peaks = _least_peaks("unet")
    best = min(peaks, key=lambda k: peaks[k])
    assert peaks[best] < peaks["optimal"]
    budget = (peaks[best] + peaks["optimal"]) // 2
    with pytest.raises(BudgetTooSmall) as err:
        F.fit(tiny("unet"), "optimal", budget, {})
    text = str(err.value)
    assert f"Use planner='{best}'" in text and "fits this budget" in text
    assert all(name in text for name in F.COMPARED)
    low = min(peaks.values())
    with pytest.raises(BudgetTooSmall) as err:
        F.fit(tiny("unet"), "ilp", low - 1, {"node_limit": 20})
    text = str(err.value)
    assert "try planner='optimal'" not in text and f"at least {low:,} B" in text


def test_shared_values_do_not_block_cuts() -> None:
    """Rotary cos/sin and the attention mask, made once and read by every layer, are
    resident: every layer's end is a clean cut (they used to make all of them unclean)."""
    graph = tiny("rope")
    shared = L.shared_values(graph.values, graph.ops, graph.module_calls)
    shapes = sorted(graph.values[v].shape for v in shared)
    assert shapes == [(2, 1, 16, 16), (16, 16), (16, 16)]  # the mask, cos and sin
    clean = {graph.cut_points[i].module for i in C.clean_cuts(graph)}
    assert {f"layers.{i}" for i in range(4)} <= clean
    peaks = _least_peaks("rope")
    assert peaks["optimal"] <= min(peaks.values())


@pytest.mark.parametrize("name,kind", [("flat", g.LEAF), ("functional", g.OP)])
def test_fine_cuts_lower_the_least_peak(name: str, kind: str) -> None:
    """A flat nn.Sequential (leaf-module ends) and functional code (op boundaries) had no
    cut but the forward's end; with them the least peak falls well below plain."""
    graph = tiny(name)
    assert any(c.kind == kind for c in graph.cut_points)
    calls = [i for i, c in enumerate(graph.cut_points) if c.kind == g.CALL]
    coarse = PLANNERS["optimal"](C.build_chain(graph, calls), None)
    without = evaluate(graph, coarse).peak_bytes
    least = F.fit(graph, "optimal", None, {}).peak_bytes
    assert least * 2 < without <= graph.peak_bytes


@pytest.mark.parametrize("name", GRAPHS)
def test_no_plan_goes_below_the_floor(name: str) -> None:
    """The floor bounds every plan's evaluated peak from below (each planner's least peak,
    the plain step's), and a budget under it is refused whatever the planner."""
    graph = tiny(name)
    floor = peak_floor(graph)
    assert 0 < floor.floor_bytes <= graph.peak_bytes
    assert floor.where.startswith(("forward op", "backward op"))
    for planner in CHEAP:
        least = F.least(graph, F.candidates(graph, C.build_chain(graph), planner, {}))
        assert least.peak_bytes >= floor.floor_bytes, planner
    plan = F.fit(graph, "optimal", None, {})
    assert any(n.startswith(f"floor {format_bytes(floor.floor_bytes)}") for n in plan.notes)


@pytest.mark.parametrize(("name", "budget_bytes"), [("unet", 744_240), ("rope", 391_334)])
def test_room_left_by_the_chain_model_buys_less_recomputation(
        name: str, budget_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the chain model over-counts, the plan for the budget evaluates well below it:
    ``fit`` plans again at a raised target and keeps a cheaper plan that still fits."""
    graph = tiny(name)
    raised = F.fit(graph, "optimal", budget_bytes, {})
    monkeypatch.setattr(F, "ROOM", 1.0)  # never plan again for room left
    first = F.fit(graph, "optimal", budget_bytes, {})
    assert evaluate(graph, raised).peak_bytes == raised.peak_bytes <= budget_bytes
    assert raised.extra_flops < first.extra_flops
    assert any(n.startswith("planned again for") for n in raised.notes)
    assert not any(n.startswith("planned again for") for n in first.notes)
