"""The ilp planner: the MILP equals brute force on random chains (depth-limited nesting), and on
a U-Net (long skips: most cut points are not clean) it beats the chain DP on the clean chain."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan import errors
from memplan.core import chain as C
from memplan.core import liveness as L
from memplan.core import schedule as S
from memplan.core.graph import Graph
from memplan.core.planners import PLANNERS, ilp
from memplan.core.planners import optimal as O
from memplan.core.planners.ilp import ilp_chain, plan_ilp, solve_milp
from memplan.errors import BudgetTooSmall
from tests.core.graphs import tiny
from tests.core.test_planners import chains, schedules

# Mutation checks (dropping one term of the model) need ~1500 examples to catch the subtlest
# one; the default keeps the suite fast. MEMPLAN_ILP_EXAMPLES=2000 for a thorough run.
EXAMPLES = int(os.environ.get("MEMPLAN_ILP_EXAMPLES", "200"))


def depth(items: tuple[S.Item, ...]) -> int:
    """Nesting depth of recompute regions (the paper's largest mirror count m(v))."""
    return max((1 + depth(it.body) for it in items if isinstance(it, S.Region)), default=0)


def test_milp_is_exact_where_highs_presolve_was_not() -> None:
    """A chain on which HiGHS's MIP presolve reported a 10-FLOP schedule optimal at budget 23,
    where a 7-FLOP one fits (found by the test below on a random draw)."""
    def a(*v: int) -> np.ndarray:
        return np.array(v, dtype=np.int64)

    c = C.Chain(fingerprint="fp", first=a(0, 1, 2, 3), last=a(0, 1, 2, 3), modules=("m",) * 4,
                   f=a(1, 1, 1, 1), b=a(1, 1, 1, 1), x=a(3, 4, 2, 1), xbar=a(6, 5, 10, 1),
                   d=a(2, 4, 2, 0), xsac=a(4, 4, 6, 1), xsac_b=a(6, 5, 10, 1),
                   fcheap=a(1, 0, 0, 0), tf=a(0, 0, 14, 0), tf0=a(0, 0, 0, 0),
                   tb=a(0, 9, 10, 0), gb=a(0, 4, 0, 0), base_bytes=3, step_flops=100,
                   xh=a(0, 1, 0, 0))
    res = solve_milp(c, 23, max_depth=4, time_limit_s=60)
    assert res.schedule is not None and res.proven
    assert S.simulate(c, res.schedule) == (23, 7)
    assert O.solve(c, 23 - c.base_bytes, slot_bytes=1)[0] == 7


def _five(**rows: tuple[int, ...]) -> C.Chain:
    def a(*v: int) -> np.ndarray:
        return np.array(v, dtype=np.int64)

    return C.Chain(fingerprint="fp", first=a(0, 1, 2, 3, 4), last=a(0, 1, 2, 3, 4),
                   modules=("m",) * 5, b=a(1, 1, 1, 1, 1), base_bytes=3, step_flops=100,
                   **{k: a(*v) for k, v in rows.items()})


@pytest.mark.parametrize("c, budget, max_depth, flops", [
    # Without presolve, HiGHS called this program infeasible (49 FLOPs fit).
    (_five(f=(12, 10, 1, 1, 1), x=(2, 9, 7, 3, 2), xbar=(10, 11, 11, 5, 6), d=(2, 3, 3, 0, 0),
           xsac=(6, 10, 9, 4, 4), xsac_b=(10, 11, 11, 5, 6), fcheap=(0, 0, 0, 0, 0),
           tf=(0, 0, 0, 6, 0), tf0=(0, 0, 1, 9, 0), tb=(0, 0, 1, 0, 1), gb=(0, 0, 6, -2, 4)),
     30, 1, 49),
    # Without presolve, HiGHS reported 19 FLOPs optimal where 18 fit.
    (_five(f=(3, 2, 6, 1, 1), x=(1, 2, 5, 4, 1), xbar=(5, 6, 9, 11, 1), d=(0, 1, 0, 0, 0),
           xsac=(3, 4, 7, 7, 1), xsac_b=(5, 6, 9, 11, 1), fcheap=(0, 2, 0, 0, 0),
           tf=(0, 0, 0, 0, 0), tf0=(0, 0, 0, 0, 0), tb=(0, 0, 0, 0, 5), gb=(0, 0, 0, 0, -1)),
     25, 2, 18),
])
def test_milp_is_exact_where_highs_without_presolve_was_not(c: C.Chain, budget: int,
                                                           max_depth: int, flops: int) -> None:
    """Chains the test below drew where HiGHS without its presolve was wrong: solved both
    ways, the better schedule is brute force's."""
    best = min(S.simulate(c, s)[1] for s in schedules(0, c.n - 1, True)
               if S.simulate(c, s)[0] <= budget and depth(s) <= max_depth)
    assert best == flops
    res = solve_milp(c, budget, max_depth=max_depth, time_limit_s=60)
    assert res.schedule is not None and res.proven
    peak, got = S.simulate(c, res.schedule)
    assert got == flops and peak <= budget and depth(res.schedule) <= max_depth


@settings(max_examples=EXAMPLES, deadline=None)
@given(chains(), st.data(), st.sampled_from([0, 1, 2, 4]))
def test_milp_equals_brute_force(c: C.Chain, data: st.DataObject, max_depth: int) -> None:
    results = [(S.simulate(c, s), depth(s)) for s in schedules(0, c.n - 1, True)]
    peaks = sorted({peak for (peak, _), dep in results if dep <= max_depth})
    budget = data.draw(st.sampled_from([peaks[0] - 1] + peaks), "budget")  # each threshold
    feasible = [flops for (peak, flops), dep in results if peak <= budget and dep <= max_depth]
    res = solve_milp(c, budget, max_depth=max_depth, time_limit_s=60)
    assert res.proven and res.retries == 0  # no retry: the model is simulate's, exactly
    if not feasible:
        assert res.schedule is None
        return
    assert res.schedule is not None
    peak, flops = S.simulate(c, res.schedule)
    assert flops == min(feasible) and peak <= budget and depth(res.schedule) <= max_depth
    if max_depth == 4:  # chains of <= 5 stages nest at most 4 deep: the DP's whole space
        assert O.solve(c, budget - c.base_bytes, slot_bytes=1)[0] == flops


@settings(max_examples=max(10, EXAMPLES // 8), deadline=None)
@given(chains(), st.sampled_from([1, 4]))
def test_milp_least_peak_equals_brute_force(c: C.Chain, max_depth: int) -> None:
    least = min(S.simulate(c, s)[0] for s in schedules(0, c.n - 1, True)
                if depth(s) <= max_depth)
    res = solve_milp(c, None, max_depth=max_depth, time_limit_s=60)
    assert res.schedule is not None and S.simulate(c, res.schedule)[0] == least
    assert res.proven and res.retries == 0


def unet_graph() -> Graph:
    return tiny("unet")


def test_unet_long_skips_make_cuts_unclean() -> None:
    g = unet_graph()
    # Call cuts at each block's end; the full-resolution decoder gap (over a quarter of what
    # the forward saves) also gets its leaf-call ends and op boundaries (liveness.fine_cuts).
    kinds = [c.kind for c in g.cut_points]
    assert kinds.count("call") == 9 and "leaf" in kinds and "op" in kinds
    # The outer encoder outputs skip past several blocks: resident, they block no cut. The
    # innermost (down.2's, read after mid) skips one block: the mid cut it crosses is not
    # clean. The fine cuts inside up.2 are: its input, held by the caller meanwhile but read
    # no more, counts in their bytes, not in what a restart there reads.
    skips = L.skip_values(g.values, g.ops, g.module_calls)
    assert sorted(g.ops[g.values[v].producer].module for v in skips) == ["down.0.5", "down.1.5"]
    mid = next(i for i, c in enumerate(g.cut_points) if c.module == "mid")
    assert C.clean_cuts(g) == [i for i in range(len(kinds)) if i != mid]
    fine = ilp_chain(g)
    assert fine.n == len(g.cut_points) and C.build_chain(g).n == len(C.clean_cuts(g))
    plain = S.simulate(fine, S.plain_schedule(fine))[0]
    assert plain == S.simulate(C.build_chain(g), S.plain_schedule(C.build_chain(g)))[0]
    assert plain == g.peak_bytes


@pytest.mark.parametrize("fraction", [0.95, 0.9, 0.8, 0.7])
def test_ilp_at_least_as_good_as_optimal_on_unet(fraction: float) -> None:
    g = unet_graph()
    budget = int(g.peak_bytes * fraction)
    plan = PLANNERS["ilp"](g, budget)
    fine, clean = ilp_chain(g), C.build_chain(g)
    # The MILP's plan over every cut, or the dynamic program's over the clean chain when better
    on = fine if [s.last_op for s in plan.stages] == fine.last.tolist() else clean
    assert [s.last_op for s in plan.stages] == on.last.tolist()
    S.validate(on, plan.schedule)
    assert S.simulate(on, plan.schedule) == (plan.peak_bytes, plan.extra_flops + int(on.f.sum()))
    assert plan.peak_bytes <= budget and plan.planner == "ilp"
    try:
        dp = PLANNERS["optimal"](g, budget)  # the clean chain
    except BudgetTooSmall:
        assert fraction <= 0.75  # the clean chain cannot go below ~0.72 of plain
        return
    assert plan.extra_flops <= dp.extra_flops


def test_ilp_least_peak_and_budget_too_small_on_unet() -> None:
    g = unet_graph()
    least = PLANNERS["ilp"](g, None)
    assert least.peak_bytes < PLANNERS["optimal"](g, None).peak_bytes
    assert any(n.startswith("the least peak: the 'optimal' dynamic program's least-peak plan")
               for n in least.notes)
    with pytest.raises(BudgetTooSmall) as err:
        PLANNERS["ilp"](g, least.peak_bytes - 1)
    assert err.value.least_peak_bytes == least.peak_bytes


def test_ilp_least_peak_is_the_dp_s_or_the_clean_chain_s_when_lower(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a budget no MILP runs: the DP's least-peak plan on ilp's chain, or on the clean
    chain where that one is lower (the chain through every cut counts skips twice)."""
    g = unet_graph()
    monkeypatch.setattr(ilp, "solve_milp", None)  # calling it would raise
    on_all = PLANNERS["ilp"](g, None)
    clean = PLANNERS["optimal"](g, None)
    assert clean.peak_bytes > on_all.peak_bytes and len(clean.stages) < len(on_all.stages)
    lower = dataclasses.replace(clean, peak_bytes=on_all.peak_bytes - 1)
    monkeypatch.setattr(ilp, "_other_dp", lambda *args: (lower, "the clean chain"))
    took = PLANNERS["ilp"](g, None)
    assert took.planner == "ilp" and took.schedule == clean.schedule
    assert took.notes[-1].endswith(
        f"on the clean chain ({len(clean.stages)} stages) it is lower and returned")


def test_ilp_over_max_stages_still_has_the_dp_plan_through_every_cut() -> None:
    """With more cut points than ``max_stages`` the MILP plans over the clean chain; the DP's
    plan through every cut point (as ``optimal`` plans) is returned where it is better: a
    Mamba layer's scan has no clean cut inside, and there ilp's least peak was 22% above
    optimal's (HF Jamba)."""
    g = unet_graph()
    n_cuts = len(g.cut_points)
    clean = PLANNERS["optimal"](g, None)  # the DP on the clean chain
    assert len(clean.stages) < n_cuts
    least = PLANNERS["ilp"](g, None, max_stages=len(clean.stages))
    assert least.notes[0] == f"chain of {len(clean.stages)} stages through clean cut points"
    assert least.peak_bytes < clean.peak_bytes and len(least.stages) == n_cuts
    assert least.notes[-1].endswith(
        f"on the chain through every cut point ({n_cuts} stages) it is lower and returned")
    budget = (least.peak_bytes + clean.peak_bytes) // 2  # below the clean chain's least peak
    at = PLANNERS["ilp"](g, budget, max_stages=len(clean.stages))
    assert at.peak_bytes <= budget and len(at.stages) == n_cuts
    assert "plan on the chain through every cut point" in at.notes[-1]


def test_ilp_bad_arguments() -> None:
    g = unet_graph()
    with pytest.raises(errors.ConfigError, match="cuts"):
        PLANNERS["ilp"](g, None, cuts="some")
    with pytest.raises(errors.ConfigError, match="time_limit_s"):
        PLANNERS["ilp"](g, None, time_limit_s=0)
    with pytest.raises(errors.ConfigError, match="time_limit_s"):
        PLANNERS["ilp"](g, None, time_limit_s="10")
    with pytest.raises(errors.ConfigError, match="stage_time_s"):
        PLANNERS["ilp"](g, None, stage_time_s=[1.0])
    assert np.array_equal(ilp_chain(g, "clean").last, C.build_chain(g).last)


@pytest.mark.parametrize("node_limit", [1, 5000])
def test_ilp_is_deterministic(node_limit: int) -> None:
    """Same input, same plan, whatever the load: HiGHS stops at a node limit (work, not
    time), and by default there is no wall-clock limit at all; notes carry no
    timing-dependent figures. A generous explicit time limit changes nothing."""
    g = unet_graph()
    budget = int(g.peak_bytes * 0.8)
    plans = [PLANNERS["ilp"](g, budget, node_limit=node_limit).to_json() for _ in range(2)]
    plans.append(PLANNERS["ilp"](g, budget, node_limit=node_limit, time_limit_s=3600).to_json())
    assert plans[0] == plans[1] == plans[2]
    assert "time" not in " ".join(json.loads(plans[0])["notes"]).replace("time_limit_s", "")
    assert inspect.signature(plan_ilp).parameters["time_limit_s"].default is None


def test_an_explicit_time_limit_that_stops_the_search_says_so() -> None:
    """A wall-clock limit is the caller's choice: a search it stops is not used (a dynamic
    program's plan is returned, the same schedule as without the limit), and the notes say
    the result then depends on the machine."""
    g = unet_graph()
    budget = int(g.peak_bytes * 0.8)
    plan = PLANNERS["ilp"](g, budget, time_limit_s=1e-9)
    assert plan.schedule == PLANNERS["ilp"](g, budget).schedule
    assert any("stopped by time_limit_s" in n and "depend on the machine" in n
               for n in plan.notes)


def test_ilp_on_a_long_chain_returns_the_exact_dp_and_says_why() -> None:
    g = unet_graph()
    chain = ilp_chain(g)  # 9 stages, over max_stages=4
    plan = PLANNERS["ilp"](chain, int(g.peak_bytes * 0.8), max_stages=4)
    dp = PLANNERS["optimal"](chain, int(g.peak_bytes * 0.8))
    assert plan.schedule == dp.schedule and plan.planner == "ilp"
    assert any("cannot beat the 'optimal' dynamic program" in n for n in plan.notes)
