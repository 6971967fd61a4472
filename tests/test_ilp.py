"""The ilp planner: the MILP equals brute force on random chains (depth-limited nesting), and on
a U-Net (long skips: most cut points are not clean) it beats the chain DP on the clean chain."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.test_planners import chains, schedules
from torch import nn

import memplan
from memplan import chain as C
from memplan import planning
from memplan.budget import BudgetTooSmall
from memplan.graph import Graph
from memplan.planners import PLANNERS
from memplan.planners import optimal as O
from memplan.planners.ilp import ilp_chain, solve_milp

# Mutation checks (dropping one term of the model) need ~1500 examples to catch the subtlest
# one; the default keeps the suite fast. MEMPLAN_ILP_EXAMPLES=2000 for a thorough run.
EXAMPLES = int(os.environ.get("MEMPLAN_ILP_EXAMPLES", "200"))


def depth(items: tuple[C.Item, ...]) -> int:
    """Nesting depth of recompute regions (the paper's largest mirror count m(v))."""
    return max((1 + depth(it.body) for it in items if isinstance(it, C.Region)), default=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(chains(), st.data(), st.sampled_from([0, 1, 2, 4]))
def test_milp_equals_brute_force(c: C.Chain, data: st.DataObject, max_depth: int) -> None:
    results = [(C.simulate(c, s), depth(s)) for s in schedules(0, c.n - 1, True)]
    peaks = sorted({peak for (peak, _), dep in results if dep <= max_depth})
    budget = data.draw(st.sampled_from([peaks[0] - 1] + peaks), "budget")  # each threshold
    feasible = [flops for (peak, flops), dep in results if peak <= budget and dep <= max_depth]
    res = solve_milp(c, budget, max_depth=max_depth, time_limit_s=60)
    assert res.proven and res.retries == 0  # no retry: the model is simulate's, exactly
    if not feasible:
        assert res.schedule is None
        return
    assert res.schedule is not None
    peak, flops = C.simulate(c, res.schedule)
    assert flops == min(feasible) and peak <= budget and depth(res.schedule) <= max_depth
    if max_depth == 4:  # chains of <= 5 stages nest at most 4 deep: the DP's whole space
        assert O.solve(c, budget - c.base_bytes, slot_bytes=1)[0] == flops


@settings(max_examples=max(10, EXAMPLES // 8), deadline=None)
@given(chains(), st.sampled_from([1, 4]))
def test_milp_least_peak_equals_brute_force(c: C.Chain, max_depth: int) -> None:
    least = min(C.simulate(c, s)[0] for s in schedules(0, c.n - 1, True)
                if depth(s) <= max_depth)
    res = solve_milp(c, None, max_depth=max_depth, time_limit_s=60)
    assert res.schedule is not None and C.simulate(c, res.schedule)[0] == least
    assert res.proven and res.retries == 0


def _block(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class UNet(nn.Module):
    """Encoder outputs skip to the decoder: every cut inside carries them (long skips)."""

    def __init__(self, width: int = 4, levels: int = 3) -> None:
        super().__init__()
        ch = [width * 2**i for i in range(levels + 1)]
        self.down = nn.ModuleList([_block(3 if i == 0 else ch[i - 1], ch[i])
                                   for i in range(levels)])
        self.mid = _block(ch[levels - 1], ch[levels])
        self.up = nn.ModuleList([_block(ch[i + 1] + ch[i], ch[i]) for i in reversed(range(levels))])
        self.head = nn.Conv2d(ch[0], 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, down in enumerate(self.down):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        x = self.mid(F.max_pool2d(x, 2))
        for up in self.up:
            x = up(torch.cat([F.interpolate(x, scale_factor=2.0), skips.pop()], 1))
        out: torch.Tensor = self.head(x)
        return out


def unet_inputs() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return UNet(), torch.randn(2, 3, 32, 32)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@functools.cache
def unet_graph() -> Graph:
    model, x = unet_inputs()
    return memplan.capture(model, x, loss_fn=_loss)


def test_unet_long_skips_make_cuts_unclean() -> None:
    g = unet_graph()
    assert len(g.cut_points) == 9 and C.clean_cuts(g) == [0, 6, 7, 8]
    fine = ilp_chain(g)
    assert fine.n == 9 and C.build_chain(g).n == 4
    plain = C.simulate(fine, C.plain_schedule(fine))[0]
    assert plain == C.simulate(C.build_chain(g), C.plain_schedule(C.build_chain(g)))[0]
    assert plain == g.meta["peak_bytes"]


@pytest.mark.parametrize("fraction", [0.95, 0.9, 0.8, 0.7])
def test_ilp_at_least_as_good_as_optimal_on_unet(fraction: float) -> None:
    g = unet_graph()
    budget = int(g.meta["peak_bytes"] * fraction)
    plan = PLANNERS["ilp"](g, budget)
    fine = ilp_chain(g)
    C.validate(fine, plan.schedule)
    assert C.simulate(fine, plan.schedule) == (plan.peak_bytes,
                                                plan.extra_flops + int(fine.f.sum()))
    assert plan.peak_bytes <= budget and plan.planner == "ilp"
    assert [s.last_op for s in plan.stages] == fine.last.tolist()
    try:
        dp = PLANNERS["optimal"](g, budget)  # the clean chain: 4 stages
    except BudgetTooSmall:
        assert fraction <= 0.85  # the clean chain cannot go below ~0.89 of plain
        return
    assert plan.extra_flops <= dp.extra_flops


def test_ilp_least_peak_and_budget_too_small_on_unet() -> None:
    g = unet_graph()
    least = PLANNERS["ilp"](g, None)
    assert least.peak_bytes < PLANNERS["optimal"](g, None).peak_bytes
    assert any(n.startswith("MILP (HiGHS, regions nested <= 2 deep)") for n in least.notes)
    with pytest.raises(BudgetTooSmall) as err:
        PLANNERS["ilp"](g, least.peak_bytes - 1)
    assert err.value.least_peak_bytes == least.peak_bytes


def test_plan_entry_point_gives_ilp_the_graph() -> None:
    model, x = unet_inputs()
    plan = planning.plan(model, x, loss_fn=_loss, budget=0.8, planner="ilp")
    assert plan.planner == "ilp" and len(plan.stages) == 9
    assert plan.peak_bytes <= int(0.8 * unet_graph().meta["peak_bytes"])
    assert plan.forward is not None


def test_ilp_bad_arguments() -> None:
    g = unet_graph()
    with pytest.raises(memplan.ConfigError, match="cuts"):
        PLANNERS["ilp"](g, None, cuts="some")
    with pytest.raises(memplan.ConfigError, match="time_limit_s"):
        PLANNERS["ilp"](g, None, time_limit_s=0)
    with pytest.raises(memplan.ConfigError, match="stage_time_s"):
        PLANNERS["ilp"](g, None, stage_time_s=[1.0])
    assert np.array_equal(ilp_chain(g, "clean").last, C.build_chain(g).last)


@pytest.mark.parametrize("fraction", [0.9, 0.7])
def test_applied_ilp_plan_stays_under_its_prediction(fraction: float) -> None:
    """Run the plan with memplan.apply: skips passing through regions are counted twice by the
    chain model, so on a U-Net the real peak is at most the predicted one (here 0-11% below)."""
    g = unet_graph()
    plan = planning.plan(g, budget=int(g.meta["peak_bytes"] * fraction), planner="ilp")
    model, x = unet_inputs()
    applied = memplan.apply(model, plan)
    measured = memplan.measure(applied, x, loss_fn=_loss, simulate=False).peak_bytes
    assert measured <= plan.peak_bytes <= int(g.meta["peak_bytes"] * fraction)


@pytest.mark.parametrize("node_limit", [1, 5000])
def test_ilp_is_deterministic(node_limit: int) -> None:
    """Same input, same plan, whatever the load: HiGHS stops at a node limit (work, not
    time); the wall-clock safety net does not change the result, and notes carry no
    timing-dependent figures."""
    g = unet_graph()
    budget = int(g.meta["peak_bytes"] * 0.8)
    plans = [PLANNERS["ilp"](g, budget, node_limit=node_limit, time_limit_s=t).to_json()
             for t in (600.0, 600.0, 3600.0)]
    assert plans[0] == plans[1] == plans[2]
    assert "time" not in " ".join(json.loads(plans[0])["notes"]).replace("time_limit_s", "")


def test_ilp_on_a_long_chain_returns_the_exact_dp_and_says_why() -> None:
    g = unet_graph()
    chain = ilp_chain(g)  # 9 stages, over max_stages=4
    plan = PLANNERS["ilp"](chain, int(g.meta["peak_bytes"] * 0.8), max_stages=4)
    dp = PLANNERS["optimal"](chain, int(g.meta["peak_bytes"] * 0.8))
    assert plan.schedule == dp.schedule and plan.planner == "ilp"
    assert any("cannot beat the 'optimal' dynamic program" in n for n in plan.notes)
