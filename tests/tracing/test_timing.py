"""objective='time': stage times measured on the real device map to the captured ops; the time
objective returns valid plans with a predicted time, and picks what is cheaper in time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import memplan
from memplan import api as planning
from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.plan import make_plan
from memplan.core.planners import PLANNERS
from memplan.tracing import timing
from tests.small import small


def test_stage_times_follow_the_captured_ops() -> None:
    w = small("lstm")
    graph = memplan.capture(w)
    runs = timing.op_times(w, graph=graph, repeat=2)
    assert len(runs) == 2 and all(len(run) == len(graph.ops) for run in runs)
    times = timing.stage_times(w, graph=graph, repeat=2)
    assert len(times) == C.build_chain(graph).n and all(t > 0 for t in times)
    fine = C.build_chain(graph, list(range(len(graph.cut_points))))
    assert len(timing.stage_times(w, graph=graph, chain=fine, repeat=1)) == fine.n


def test_timing_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    x = torch.randn(4, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    times = timing.stage_times(model, x, loss_fn=lambda out: out.mean(), repeat=2)
    assert len(times) >= 1
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_times_of_another_model_are_refused() -> None:
    with pytest.raises(memplan.MemplanError, match="first differ at op 0"):
        timing.stage_times(small("lstm"), graph=memplan.capture(small("gpt")), repeat=1)
    with pytest.raises(memplan.ConfigError, match="repeat"):
        timing.op_times(small("lstm"), repeat=0)


@pytest.mark.parametrize("planner", ["optimal", "ilp"])
def test_objective_time_measures_stage_times(planner: str) -> None:
    w = small("lstm")  # plain peak 334,920 B, least (optimal) 320,376 B
    plan = planning.plan(w, budget=330_000, planner=planner, objective="time")
    graph = memplan.capture(w)
    assert plan.planner == planner and plan.params["objective"] == "time"
    assert plan.predicted_time_s is not None and plan.predicted_time_s > 0
    assert plan.peak_bytes <= 330_000 < graph.peak_bytes
    chain = C.build_chain(graph) if planner == "optimal" else C.build_chain(
        graph, list(range(len(graph.cut_points))))
    S.validate(chain, plan.schedule)
    with pytest.raises(memplan.ConfigError, match="objective='time'"):
        planning.plan(w, budget=330_000, planner="sqrt", objective="time")


def _chain() -> C.Chain:
    """Stage 0 has 10x the FLOPs of stage 1 but runs 5x faster (say, a convolution with a
    fast kernel against a memory-bound op): at 20 B one of them must be recomputed."""
    a = lambda *v: np.array(v, dtype=np.int64)
    return C.Chain("synthetic", a(0, 1, 2), a(0, 1, 2), ("a", "b", "loss"), f=a(100, 10, 1),
                   b=a(200, 20, 2), x=a(1, 1, 1), xbar=a(10, 10, 1), d=a(0, 0, 0),
                   xsac=a(10, 10, 1), xsac_b=a(10, 10, 1), fcheap=a(0, 0, 0), tf=a(0, 0, 0),
                   tf0=a(0, 0, 0), tb=a(0, 0, 0), gb=a(0, 0, 0), base_bytes=0, step_flops=333)


@pytest.mark.parametrize("planner", ["optimal", "ilp"])
def test_time_objective_picks_what_is_cheaper_in_time(planner: str) -> None:
    chain, times = _chain(), [1.0, 5.0, 0.1]
    assert S.simulate(chain, S.plain_schedule(chain))[0] == 21
    by_flops = PLANNERS[planner](chain, 20, drop_cheap=False)
    by_time = PLANNERS[planner](chain, 20, drop_cheap=False, stage_time_s=times)
    K, R = S.Keep, S.Region
    assert by_flops.schedule == (K(0), R(1, 1, (K(1),)), K(2)) and by_flops.extra_flops == 10
    assert by_time.schedule == (R(0, 0, (K(0),)), K(1), K(2)) and by_time.extra_flops == 100
    assert by_time.predicted_time_s == 3.0 * sum(times) + 1.0
    flops_plan_time = make_plan(chain, by_flops.schedule, planner, {}, 20, (), times)
    assert flops_plan_time.predicted_time_s == 3.0 * sum(times) + 5.0
