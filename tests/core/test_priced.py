"""The optimal planner's proof at tight budgets (``priced``, ``body_bounds``): bounds below
every subproblem's true cost, and caps by need that keep the optimum and its schedule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.core import chain as C
from memplan.core.planners import frontier as F
from memplan.core.planners import program as P
from memplan.core.planners import search as Q
from memplan.core.planners.body_bounds import fill_bounds, item_kinds
from memplan.core.planners.priced import Relaxation, prefix_costs, relax
from tests.core.test_planners import chains, repeating_chains, uniform_chain

CHAINS = st.one_of(chains(), repeating_chains(max_k=12))


def _setup(c: C.Chain, budget: int, dc: bool = True) -> tuple[P.Shape, int, P.Program]:
    shape = P.Shape.of(P.stage_table(c), dc)
    free = budget - c.base_bytes
    return shape, free, shape.fill(free, None)


@settings(max_examples=150, deadline=None)
@given(CHAINS, st.integers(0, 120))
def test_body_bounds_lie_below_every_body(c: C.Chain, budget: int) -> None:
    """At every point of every body's frontier (the unpruned program's), the bound is
    defined and no dearer: at the least need of any schedule of the body, and above it."""
    shape, free, full = _setup(c, budget)
    if free < 0:
        return
    n_cls, k = len(shape.min_gb), c.n
    mcap = free + shape.credit()
    bpool, btab = fill_bounds(shape.st, shape.cid, mcap - shape.min_gb, item_kinds(shape.st))
    for s in range(k - 1):
        for t in range(s, k - 1):
            row, _ = F.ref(shape.cid, shape.st[F.GB], n_cls, s, t)
            for dr in range(2):
                off, n = full.tab[row, dr]
                for need, cost, _ in full.pool[off : off + n]:
                    i = F.find(bpool, btab[row, dr, 0], btab[row, dr, 1], need)
                    assert i >= 0, (s, t, dr, need)
                    assert bpool[btab[row, dr, 0] + i, 1] <= cost, (s, t, dr, need)


@settings(max_examples=150, deadline=None)
@given(CHAINS, st.integers(0, 120), st.integers(0, 60), st.booleans())
def test_caps_keep_the_optimum_and_its_schedule(c: C.Chain, budget: int, extra: int,
                                                        dc: bool) -> None:
    """For any cost at or above the optimum: the relaxation's root lies at or below the
    optimum, and the program under the caps has the optimum and the unpruned schedule."""
    shape, free, full = _setup(c, budget, dc)
    hit = full.point(0, c.n - 1, 0, free) if free >= 0 else None
    if hit is None:
        return
    upper = hit[0] + extra
    mcap = free + shape.credit()
    bodies = fill_bounds(shape.st, shape.cid, mcap - shape.min_gb, item_kinds(shape.st))
    relaxed = relax(shape.st, shape.cid, bodies, free, shape.credit(), upper, dc)
    assert relaxed.root <= hit[0]
    capped = shape.fill(free, None, relaxed.caps(upper))
    assert capped.point(0, c.n - 1, 0, free) == hit
    assert capped.schedule(0, c.n - 1, 0, free) == full.schedule(0, c.n - 1, 0, free)
    assert len(capped.pool) <= len(full.pool)


@settings(max_examples=150, deadline=None)
@given(CHAINS, st.integers(0, 120), st.integers(2, 7), st.booleans())
def test_coarse_buckets_keep_a_bound_and_the_optimum(c: C.Chain, budget: int, unit: int,
                                                     dc: bool) -> None:
    """Held bytes in buckets of several bytes (a chain of these sizes gets one byte per bucket
    from ``relax``): the root lies at or below the one of one-byte buckets, which lies at or
    below the optimum, and the caps of the optimum's cost keep it and its schedule."""
    shape, free, full = _setup(c, budget, dc)
    hit = full.point(0, c.n - 1, 0, free) if free >= 0 else None
    if hit is None:
        return
    credit = shape.credit()
    bodies = fill_bounds(shape.st, shape.cid, free + credit - shape.min_gb, item_kinds(shape.st))
    fine, coarse = (prefix_costs(shape.st, shape.cid, *bodies, free, credit, u, hit[0], dc)
                    for u in (1, unit))
    assert coarse[-1].min() <= fine[-1].min() <= hit[0]
    capped = shape.fill(free, None, Relaxation(bodies, coarse, unit, free, credit).caps(hit[0]))
    assert capped.point(0, c.n - 1, 0, free) == hit
    assert capped.schedule(0, c.n - 1, 0, free) == full.schedule(0, c.n - 1, 0, free)


def test_bucket_rounding_does_not_add_up_along_the_chain() -> None:
    """60 equal steps whose bytes are no multiples of the bucket (keep 937, checkpoint 213, in
    buckets of 100): each state keeps the exact bytes its prefixes hold, so the root is the
    optimum, as with one-byte buckets. Rounding each step down to its bucket lost 37 bytes a
    keep and put the root at 4194 against the optimum 4234."""
    def rep(v: int, last: int) -> np.ndarray:
        return np.array([v] * 59 + [last], dtype=np.int64)

    c = C.Chain("odd", np.arange(60), np.arange(60), ("m",) * 60, f=rep(40, 1), b=rep(80, 1),
                x=rep(213, 1), xbar=rep(1037, 1), d=rep(100, 0), xsac=rep(737, 1),
                xsac_b=rep(1537, 1), fcheap=rep(3, 0), tf=rep(1137, 1), tf0=rep(437, 1),
                tb=rep(637, 1), gb=rep(2000, 0), base_bytes=50, step_flops=130 * 60)
    shape = P.Shape.of(P.stage_table(c), True)
    free = P.least_need(shape) + 10_000
    hit = shape.fill(free, None).point(0, c.n - 1, 0, free)
    assert hit is not None and hit[0] == 4234
    credit = shape.credit()
    bodies = fill_bounds(shape.st, shape.cid, free + credit - shape.min_gb, item_kinds(shape.st))
    lp = prefix_costs(shape.st, shape.cid, *bodies, free, credit, 100, hit[0], True)
    assert lp[-1].min() == hit[0]


def test_caps_cut_what_no_plan_within_them_uses() -> None:
    """60 equal steps a little above their least peak (bodies nest one level): the
    relaxation's root is within 1 % of the optimum, and the caps of the optimum's own cost
    keep a tenth of the frontiers' points (302 of 2828), and the optimum."""
    c = uniform_chain(60)
    shape = P.Shape.of(P.stage_table(c), True)
    free = P.least_need(shape) + 20
    full = shape.fill(free, None)
    hit = full.point(0, c.n - 1, 0, free)
    assert hit is not None
    relaxed = shape.relax(free, hit[0])
    capped = shape.fill(free, None, relaxed.caps(hit[0]))
    assert capped.point(0, c.n - 1, 0, free) == hit
    assert len(capped.pool) < len(full.pool) / 8
    assert hit[0] * 0.99 < relaxed.root <= hit[0]
    # Within a cost below the root, no prefix reaches the end.
    assert shape.relax(free, relaxed.root - 1).root >= F.BIG


@pytest.mark.parametrize("reprobe", [0, 1 << 40])
@pytest.mark.parametrize("extra", [2, 5, 20])
def test_search_proves_a_probes_plan_under_caps_by_need(extra: int, reprobe: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With every proof capped by need (PRICED = 1) and with or without the one more probe
    (REPROBE), the search returns the unpruned program's optimum and schedule. (At extra 2
    the probe's plan costs the relaxation's root: nothing to probe for.)"""
    c = uniform_chain(60)
    shape = P.Shape.of(P.stage_table(c), True)
    free = P.least_need(shape) + extra
    monkeypatch.setattr(Q, "PRICED", 1)
    monkeypatch.setattr(Q, "REPROBE", reprobe)
    fills: list[tuple[bool, bool]] = []  # (capped by need, a probe's cost caps)
    probe = [False]
    cost_caps, fill = Q.cost_caps, P.Shape.fill

    def caps_spy(*args: object) -> object:
        probe[0] = len(args) > 3 and args[3] is not None
        return cost_caps(*args)  # type: ignore[arg-type]

    def fill_spy(self: P.Shape, free: int, caps: object, by_need: object = None
                 ) -> P.Program:
        fills.append((by_need is not None, probe[0]))
        return fill(self, free, caps, by_need)  # type: ignore[arg-type]

    monkeypatch.setattr(Q, "cost_caps", caps_spy)
    monkeypatch.setattr(P.Shape, "fill", fill_spy)
    found = Q.search(shape, free)
    assert fills[-1][0], "the proof was not capped by need: this case no longer covers it"
    if extra > 2:  # the probe's plan lies above the root: probed again, or not
        assert ((True, True) in fills) == (reprobe == 0)
    full = shape.fill(free, None)
    assert found is not None
    assert found.point(0, c.n - 1, 0, free) == full.point(0, c.n - 1, 0, free)
    assert found.schedule(0, c.n - 1, 0, free) == full.schedule(0, c.n - 1, 0, free)
