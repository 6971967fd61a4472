"""The optimal planner's proof at tight budgets (``priced``, ``body_bounds``): bounds below
every subproblem's true cost, and caps by need that keep the optimum and its schedule."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.core import chain as C
from memplan.core.planners import frontier as F
from memplan.core.planners import optimal as O
from memplan.core.planners.body_bounds import fill_bounds, item_kinds
from memplan.core.planners.priced import caps_by_need
from tests.core.test_planners import chains, repeating_chains, uniform_chain

CHAINS = st.one_of(chains(), repeating_chains(max_k=12))


def _setup(c: C.Chain, budget: int, dc: bool = True) -> tuple[O._Shape, int, O._Program]:
    shape = O._Shape.of(O.stage_table(c), dc)
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
def test_caps_by_need_keep_the_optimum_and_its_schedule(c: C.Chain, budget: int, extra: int,
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
    *_, root = caps_by_need(shape.st, shape.cid, len(shape.min_gb), bodies, free,
                            shape.credit(), upper, dc)
    assert root <= hit[0]
    by_need = shape.priced(free, upper)
    assert by_need is not None
    capped = shape.fill(free, None, by_need)
    assert capped.point(0, c.n - 1, 0, free) == hit
    assert capped.schedule(0, c.n - 1, 0, free) == full.schedule(0, c.n - 1, 0, free)
    assert len(capped.pool) <= len(full.pool)


def test_caps_cut_what_no_plan_within_them_uses() -> None:
    """60 equal steps a little above their least peak (bodies nest one level): the
    relaxation's root is within 1 % of the optimum, and the caps of the optimum's own cost
    keep a tenth of the frontiers' points (302 of 2828), and the optimum."""
    c = uniform_chain(60)
    shape = O._Shape.of(O.stage_table(c), True)
    free = O.least_need(shape) + 20
    full = shape.fill(free, None)
    hit = full.point(0, c.n - 1, 0, free)
    assert hit is not None
    by_need = shape.priced(free, hit[0])
    assert by_need is not None
    capped = shape.fill(free, None, by_need)
    assert capped.point(0, c.n - 1, 0, free) == hit
    assert len(capped.pool) < len(full.pool) / 8
    mcap = free + shape.credit()
    bodies = fill_bounds(shape.st, shape.cid, mcap - shape.min_gb, item_kinds(shape.st))
    *_, root = caps_by_need(shape.st, shape.cid, len(shape.min_gb), bodies, free,
                            shape.credit(), hit[0], True)
    assert hit[0] * 0.99 < root <= hit[0]
    assert shape.priced(free, root - 1) is None and shape.priced(free, root) is not None
