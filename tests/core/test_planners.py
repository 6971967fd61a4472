"""Planners: optimal equals brute force on random chains; every plan is valid and fits."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.plan import Plan
from memplan.core.planners import PLANNERS, pareto
from memplan.core.planners import optimal as O
from memplan.errors import BudgetTooSmall
from tests.core.graphs import TINY, tiny


def schedules(s: int, t: int, top: bool) -> Iterator[tuple[S.Item, ...]]:
    """Every schedule tiling stages s..t (brute force)."""
    if s > t:
        yield ()
        return
    for rest in schedules(s + 1, t, top):
        yield (S.Keep(s),) + rest
        if top:
            yield (S.DropCheap(s),) + rest
    for e in range(s, t):
        for body in schedules(s, e, False):
            for rest in schedules(e + 1, t, top):
                yield (S.Region(s, e, body),) + rest


@st.composite
def chains(draw: st.DrawFn) -> C.Chain:
    k = draw(st.integers(1, 5))
    ints = lambda lo, hi: np.array(draw(st.lists(st.integers(lo, hi), min_size=k, max_size=k)),
                                   dtype=np.int64)
    x = ints(1, 9)
    d = np.minimum(ints(0, 5), x)
    own = ints(0, 9)
    tf, tf0 = ints(0, 15), ints(0, 10)
    # Replay transients (the runtime frees at last use): at most the plain ones, or absent.
    replay = draw(st.booleans())
    return C.Chain("fp", np.arange(k), np.arange(k), ("m",) * k, ints(1, 20), ints(1, 40), x,
                   x + own, d, x + own // 2, x + own + ints(0, 3), ints(0, 5), tf,
                   tf0, ints(0, 15), ints(-5, 10), 3, 100,
                   tfr=np.minimum(tf, ints(0, 15)) if replay else None,
                   tfr0=np.minimum(tf0, ints(0, 10)) if replay else None,
                   tfs=np.minimum(tf, ints(0, 15)) if replay else None)


@settings(max_examples=150, deadline=None)
@given(chains(), st.integers(0, 90))
def test_optimal_equals_brute_force(c: C.Chain, budget: int) -> None:
    results = [S.simulate(c, s) for s in schedules(0, c.n - 1, True)]
    feasible = [flops for peak, flops in results if peak <= budget]
    cost, sch = O.solve(c, budget - c.base_bytes, slot_bytes=1)
    assert cost == (min(feasible) if feasible else np.inf)
    if sch is not None:
        peak, flops = S.simulate(c, sch)
        assert peak <= budget and flops == cost


@pytest.mark.parametrize("name", sorted(TINY))
def test_plain_model_equals_trace(name: str) -> None:
    g = tiny(name)
    chain = C.build_chain(g)
    peak, flops = S.simulate(chain, S.plain_schedule(chain))
    assert peak == g.peak_bytes and flops == g.fwd_flops


def _check_valid(plan: Plan, chain: C.Chain) -> None:
    S.validate(chain, plan.schedule)
    assert [s.index for s in plan.stages] == list(range(chain.n))
    assert plan.stages[0].first_op == 0
    assert all(a.last_op + 1 == b.first_op for a, b in zip(plan.stages, plan.stages[1:]))
    assert S.simulate(chain, plan.schedule) == (plan.peak_bytes,
                                                 plan.extra_flops + int(chain.f.sum()))
    assert plan.extra_flops >= 0 and plan.peak_bytes <= plan.plain_peak_bytes + int(chain.x.max())
    assert plan.graph_fingerprint == chain.fingerprint
    assert Plan.from_json(plan.to_json()) == plan
    assert "peak" in plan.explain()


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_every_planner_valid(name: str, planner: str) -> None:
    chain = C.build_chain(tiny(name))
    plan = PLANNERS[planner](chain, None)
    _check_valid(plan, chain)
    budget = plan.peak_bytes
    again = PLANNERS[planner](chain, budget)  # a budget it met fits again
    assert again.peak_bytes <= budget
    _check_valid(again, chain)
    assert PLANNERS[planner](chain, budget) == again  # deterministic


def test_optimal_beats_or_ties_others_and_raises_below_least() -> None:
    chain = C.build_chain(tiny("resnet"))
    least = PLANNERS["optimal"](chain, None)
    for name in ("sqrt", "chen", "recursive"):
        other = PLANNERS[name](chain, None)
        fitted = PLANNERS["optimal"](chain, other.peak_bytes, slots=512)
        assert fitted.extra_flops <= other.extra_flops
    with pytest.raises(BudgetTooSmall) as err:
        PLANNERS["optimal"](chain, least.peak_bytes // 2)
    assert err.value.least_peak_bytes == least.peak_bytes
    assert f"{least.peak_bytes:,} B" in str(err.value)


def test_pareto_is_a_frontier() -> None:
    front = pareto(C.build_chain(tiny("lstm")), points=6)
    assert len(front) >= 2
    for a, b in itertools.pairwise(front):
        assert a.peak_bytes <= b.peak_bytes and a.extra_flops > b.extra_flops
