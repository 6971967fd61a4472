"""Planners: optimal equals brute force on random chains; every plan is valid and fits."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.plan import Plan
from memplan.core.planners import PLANNERS, bounds, pareto
from memplan.core.planners import optimal as O
from memplan.core.planners import program as P
from memplan.core.planners import search as Q
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
def chains(draw: st.DrawFn, size: int | None = None) -> C.Chain:
    k = size or draw(st.integers(1, 5))
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
                   tfs=np.minimum(tf, ints(0, 15)) if replay else None,
                   xh=ints(0, 6) if draw(st.booleans()) else None)


@st.composite
def repeating_chains(draw: st.DrawFn, max_k: int = 6) -> C.Chain:
    """Chains of stages drawn from two or three kinds (residual units, LSTM steps): the
    optimal planner solves equal sub-chains once, gradient bytes relative to their end.
    gb grows by a per-kind step towards the input, as parameter gradients accumulate."""
    kinds = [draw(chains(size=1)) for _ in range(draw(st.integers(1, 3)))]
    seq = draw(st.lists(st.integers(0, len(kinds) - 1), min_size=1, max_size=max_k))
    steps = draw(st.lists(st.integers(-5, 25), min_size=1, max_size=2))  # not tied to kinds
    step = draw(st.lists(st.sampled_from(steps), min_size=len(seq), max_size=len(seq)))
    pick = {n: np.array([getattr(kinds[i], n)[0] for i in seq], dtype=np.int64) for n in (
        "f", "b", "x", "xbar", "d", "xsac", "xsac_b", "fcheap", "tf", "tf0", "tb", "held_end")}
    pick["xh"] = pick.pop("held_end")
    gb = np.cumsum(step[::-1])[::-1] + draw(st.integers(-5, 10))
    with_replay = all(kind.tfr is not None for kind in kinds)
    replay = {n: np.array([getattr(kinds[i], n)[0] for i in seq], dtype=np.int64)
              if with_replay else None for n in ("tfr", "tfr0", "tfs")}
    k = len(seq)
    return C.Chain("fp", np.arange(k), np.arange(k), ("m",) * k, gb=gb.astype(np.int64),
                   base_bytes=3, step_flops=100, **pick, **replay)


def brute_force(c: C.Chain, budget: int) -> float:
    feasible = [flops for peak, flops in (S.simulate(c, s) for s in schedules(0, c.n - 1, True))
                if peak <= budget]
    return min(feasible) if feasible else np.inf


@settings(max_examples=150, deadline=None)
@given(st.one_of(chains(), repeating_chains()), st.integers(0, 90))
def test_optimal_equals_brute_force(c: C.Chain, budget: int) -> None:
    cost, sch = O.solve(c, budget - c.base_bytes)  # exact bytes (the default)
    assert cost == brute_force(c, budget)
    if sch is not None:
        peak, flops = S.simulate(c, sch)
        assert peak <= budget and flops == cost


@settings(max_examples=100, deadline=None)
@given(st.one_of(chains(), repeating_chains()), st.integers(0, 90), st.sampled_from([8, 32]))
def test_slot_mode_never_exceeds_the_budget(c: C.Chain, budget: int, slots: int) -> None:
    cost, sch = O.solve(c, budget - c.base_bytes, slots=slots)
    assert cost >= brute_force(c, budget)  # rounded against the plan: never better
    if sch is not None:
        peak, flops = S.simulate(c, sch)
        assert peak <= budget and flops == cost


@settings(max_examples=100, deadline=None)
@given(st.one_of(chains(), repeating_chains()))
def test_least_need_equals_brute_force(c: C.Chain) -> None:
    least = min(S.simulate(c, s)[0] for s in schedules(0, c.n - 1, True))
    shape = P.Shape.of(P.stage_table(c), True)
    assert P.least_need(shape) == least - c.base_bytes
    assert O.solve(c, least - c.base_bytes - 1) == (np.inf, None)


def mirrors(c: C.Chain, items: tuple[S.Item, ...], depth: int = 0) -> np.ndarray:
    """Per stage: extra forward cost in a schedule (mirror count x FLOPs, drop-cheap's part)."""
    extra = np.zeros(c.n)
    for it in items:
        if isinstance(it, S.Region):
            extra[it.start : it.end + 1] += c.f[it.start : it.end + 1]
            extra += mirrors(c, it.body, depth + 1)
        elif isinstance(it, S.DropCheap):
            extra[it.stage] += c.fcheap[it.stage]
    return extra


@settings(max_examples=100, deadline=None)
@given(st.one_of(chains(), repeating_chains()), st.integers(0, 90), st.booleans())
def test_recompute_bounds_are_lower_bounds(c: C.Chain, budget: int, dc: bool) -> None:
    """Every schedule that fits pays at least the bound, and so does each of its prefixes."""
    lb_total, lb_prefix = bounds.recompute_bounds(P.stage_table(c), budget - c.base_bytes, dc)
    for sch in schedules(0, c.n - 1, True):
        if (not dc and any(isinstance(it, S.DropCheap) for it in sch)) or (
                S.simulate(c, sch)[0] > budget):
            continue
        extra = np.cumsum(mirrors(c, sch))
        assert extra[-1] >= lb_total - 1e-6
        assert (np.concatenate(([0.0], extra[:-1])) >= lb_prefix - 1e-6).all()


def full_program(c: C.Chain, free: int, share: bool) -> float:
    """The optimum without the cost caps of the search (and, share=False, with every
    sub-chain solved on its own)."""
    if free < 0:
        return np.inf
    shape = P.Shape.of(P.stage_table(c), True, share=share)
    hit = shape.fill(free, None).point(0, c.n - 1, 0, free)
    return np.inf if hit is None else hit[0]


@settings(max_examples=60, deadline=None)
@given(repeating_chains(max_k=14), st.integers(0, 120))
def test_pruning_and_sharing_keep_the_optimum(c: C.Chain, budget: int) -> None:
    """On chains longer than brute force reaches: the search with cost caps from the lower
    bounds (planners.bounds) equals the program without them, which equals the one that
    solves every sub-chain on its own (planners.repeats)."""
    free = budget - c.base_bytes
    cost, _ = O.solve(c, free)
    assert cost == full_program(c, free, share=True) == full_program(c, free, share=False)


def test_a_gradient_step_after_a_sub_chain_leaves_its_class() -> None:
    """Equal stages, gradient bytes stepping down after stage 4 (where an LSTM's last steps
    make the weights' gradients): sub-chains ending at 4 differ from the others only past
    their end, so they share the others' classes; those reaching past 4 do not."""
    c = dataclasses.replace(uniform_chain(9), gb=np.array([20] * 5 + [8] * 3 + [0]))
    cid = P.Shape.of(P.stage_table(c), True).cid
    for n in (1, 2, 3):  # stage 0 differs (no input gradient to credit): from stage 1
        assert cid[4 - n + 1, n - 1] == cid[1, n - 1]  # ending at 4
    assert cid[4, 1] != cid[1, 1] and cid[3, 2] != cid[1, 2]  # 4..5, 3..5: across the step


def unit_chain(x: list[int]) -> C.Chain:
    """Stages of one FLOP each, kept bytes x (caps one unit too tight show here)."""
    k, one, zero = len(x), np.ones(len(x), dtype=np.int64), np.zeros(len(x), dtype=np.int64)
    xs = np.array(x, dtype=np.int64)
    return C.Chain("fp", np.arange(k), np.arange(k), ("m",) * k, one, one, xs, xs, zero, xs,
                   xs, zero, zero, zero, zero, zero, 3, 100)


@settings(max_examples=120, deadline=None)
@given(st.one_of(chains(), repeating_chains(max_k=14)), st.integers(0, 120), st.booleans())
@example(unit_chain([1, 2, 6, 9]), 19, True)
def test_pruned_search_returns_the_unpruned_schedule(c: C.Chain, budget: int, dc: bool
                                                     ) -> None:
    """The search's cost caps (planners.bounds) drop only what no plan within them uses, so
    ties break as without them: the schedule read back, not just its cost, equals the one of
    the program without caps."""
    free = budget - c.base_bytes
    shape = P.Shape.of(P.stage_table(c), dc)
    pruned = Q.search(shape, free)
    full = shape.fill(free, None) if free >= 0 else None
    if pruned is None or full is None:
        assert pruned is None and (full is None or full.point(0, c.n - 1, 0, free) is None)
        return
    assert full.point(0, c.n - 1, 0, free) == pruned.point(0, c.n - 1, 0, free)
    assert full.schedule(0, c.n - 1, 0, free) == pruned.schedule(0, c.n - 1, 0, free)


@settings(max_examples=60, deadline=None)
@given(repeating_chains(max_k=14), st.integers(0, 120), st.integers(0, 4000))
def test_a_starting_cost_changes_nothing(c: C.Chain, budget: int, upper: int) -> None:
    """The search's first caps may come from any plan's cost (``optimal.upper_cost``), too low or
    high: the program found, and so the plan, is the same as without it."""
    free = budget - c.base_bytes
    shape = P.Shape.of(P.stage_table(c), True)
    plain, started = Q.search(shape, free), Q.search(shape, free, upper)
    assert (plain is None) == (started is None)
    if plain is not None and started is not None:
        assert plain.point(0, c.n - 1, 0, free) == started.point(0, c.n - 1, 0, free)
        assert plain.schedule(0, c.n - 1, 0, free) == started.schedule(0, c.n - 1, 0, free)


def uniform_chain(k: int) -> C.Chain:
    """An LSTM-like chain: equal steps, then a loss stage; gradient bytes of shared weights."""
    def rep(v: int, last: int) -> np.ndarray:
        return np.array([v] * (k - 1) + [last], dtype=np.int64)

    return C.Chain("fp", np.arange(k), np.arange(k), ("m",) * k, f=rep(40, 1), b=rep(80, 1),
                   x=rep(2, 1), xbar=rep(10, 1), d=rep(1, 0), xsac=rep(7, 1), xsac_b=rep(15, 1),
                   fcheap=rep(3, 0), tf=rep(11, 1), tf0=rep(4, 1), tb=rep(6, 1), gb=rep(20, 0),
                   base_bytes=50, step_flops=130 * k)


@pytest.mark.parametrize("extra", [0, 1, 2, 5, 20, 60, 200])
def test_long_uniform_chain_nests_and_stays_exact(extra: int) -> None:
    """60 equal stages: near the least peak the optimum nests regions; the search (caps,
    sharing) equals the full program at every budget."""
    c = uniform_chain(60)
    least = P.least_need(P.Shape.of(P.stage_table(c), True))
    free = least + extra
    cost, sch = O.solve(c, free)
    assert sch is not None and cost == full_program(c, free, share=False)
    peak, flops = S.simulate(c, sch)
    assert peak <= c.base_bytes + free and flops == cost
    if extra <= 5:
        assert O.nesting(sch) >= 2


@pytest.mark.parametrize("extra", [0, 1, 2, 5])
def test_a_probing_search_returns_the_unpruned_schedule(extra: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Near the least peak the bound ignores the nesting, the caps miss twice and the search
    probes (the top level's slack PROBE_TOP times the bodies'): the program it returns still
    holds the full program's optimum and schedule."""
    c = uniform_chain(60)
    shape = P.Shape.of(P.stage_table(c), True)
    free = P.least_need(shape) + extra
    probes: list[int] = []
    caps = Q.cost_caps

    def spy(*args: object) -> object:
        if len(args) > 3 and args[3] is not None:
            probes.append(int(args[3]))  # type: ignore[call-overload]
        return caps(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(Q, "cost_caps", spy)
    found = Q.search(shape, free)
    full = shape.fill(free, None)
    assert probes, "the search never probed: this case no longer covers it"
    assert found is not None
    assert found.point(0, c.n - 1, 0, free) == full.point(0, c.n - 1, 0, free)
    assert found.schedule(0, c.n - 1, 0, free) == full.schedule(0, c.n - 1, 0, free)


@pytest.mark.parametrize("extra", [2, 5, 20])
def test_a_probes_plan_above_its_slack_is_proved_by_one_last_fill(
        extra: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe (bodies' slack small, top level's PROBE_TOP times larger) finds a plan costing
    more than its bodies' slack above the bound: one last fill, every slack that plan's, keeps
    every cheaper plan, and its optimum and schedule are the full program's."""
    c = uniform_chain(60)
    shape = P.Shape.of(P.stage_table(c), True)
    free = P.least_need(shape) + extra
    fills: list[tuple[int, int] | None] = []
    fill = P.Shape.fill

    def spy(self: P.Shape, free: int, caps: tuple[np.ndarray, int] | None,
            *by_need: object) -> P.Program:
        fills.append(None if caps is None else (int(caps[0][0]), int(caps[1])))
        return fill(self, free, caps, *by_need)  # type: ignore[arg-type]

    monkeypatch.setattr(P.Shape, "fill", spy)
    found = Q.search(shape, free)
    assert found is not None and None not in fills
    *_, (probe_top, probe_inner), (last_top, last_inner) = fills  # type: ignore[misc]
    assert probe_top - probe_inner > last_top - last_inner  # the probe's top level: larger
    assert last_inner > probe_inner  # the proof's bodies' slack: the plan's, above the probe's
    full = shape.fill(free, None)
    assert found.point(0, c.n - 1, 0, free) == full.point(0, c.n - 1, 0, free)
    assert found.schedule(0, c.n - 1, 0, free) == full.schedule(0, c.n - 1, 0, free)


def _runs(items: tuple[S.Item, ...]) -> int:
    """Stage runs of a schedule, replays included."""
    return sum(it.end - it.start + 1 + _runs(it.body) if isinstance(it, S.Region) else 1
               for it in items)


@pytest.mark.parametrize("extra", [0, 30, 300])
def test_costs_in_units_stay_within_half_a_unit_per_run(extra: int) -> None:
    """plan_optimal counts costs of long chains in units of 2**-COST_BITS of the forward pass:
    on a chain whose drop-cheap costs round to nothing, its plan costs at most half a unit per
    stage run (its own and the exact optimum's) more than the exact optimum, and says so."""
    def scaled(base: C.Chain) -> C.Chain:  # FLOPs of a real model, drop-cheap's tiny
        return dataclasses.replace(base, f=base.f * 10**6, step_flops=base.step_flops * 10**6,
                                   fcheap=np.minimum(base.fcheap, 3))

    c = scaled(uniform_chain(150))  # over COARSE_STAGES: shorter chains are counted exactly
    cost, unit = O.cost_units(c, None)
    assert cost is not None and unit > 1 and not np.rint(c.fcheap / unit).any()
    free = P.least_need(P.Shape.of(P.stage_table(c), True)) + extra * 10
    exact, best = O.solve(c, free)  # FLOPs, exact
    assert best is not None
    plan = O.plan_optimal(c, c.base_bytes + free)
    flops = S.simulate(c, plan.schedule)[1]
    assert exact <= flops <= exact + (_runs(plan.schedule) + _runs(best)) * unit // 2
    assert any(n.startswith(f"costs counted in units of {unit:,} FLOPs") for n in plan.notes)
    assert O.cost_units(uniform_chain(150), None) == (None, 1)  # costs sum < 2**19: exact
    assert O.cost_units(scaled(uniform_chain(O.COARSE_STAGES)), None) == (None, 1)


def test_least_peak_schedules_are_remembered_by_content(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A refused budget asks for the least peak of the same chain up to three times: the
    search runs once per content (table, tolerance, drop-cheap), whichever Chain object asks."""
    searches: list[int] = []
    search = O.search

    def spy(shape: P.Shape, free: int, upper: int | None = None) -> P.Program | None:
        searches.append(free)
        return search(shape, free, upper)

    monkeypatch.setattr(O, "search", spy)
    monkeypatch.setattr(O, "_least_peaks", {})
    first = O.least_peak_schedule(uniform_chain(40))
    again = O.least_peak_schedule(uniform_chain(40))  # an equal chain, another object
    assert again == first and len(searches) == 1
    assert O.least_peak_schedule(uniform_chain(40), allow_drop_cheap=False) is not first
    assert O.least_peak_schedule(uniform_chain(41)) != first and len(searches) == 3
    monkeypatch.setattr(O, "_least_peaks", {})
    assert O.least_peak_schedule(uniform_chain(40)) == first  # as computed afresh
    for k in range(O.LEAST_PEAK_CACHED + 2):  # bounded: the oldest go
        O.least_peak_schedule(uniform_chain(5 + k))
    assert len(O._least_peaks) == O.LEAST_PEAK_CACHED


@pytest.mark.parametrize("extra", [3, 40, 400])
def test_chain_longer_than_the_coarse_one_stays_exact(extra: int) -> None:
    """150 stages: the search starts from the 100-group plan's cost (``optimal.upper_cost``) and
    still finds the full program's optimum; schedule_cost is the simulated cost."""
    c = uniform_chain(150)
    assert c.n > O.COARSE_STAGES
    free = P.least_need(P.Shape.of(P.stage_table(c), True)) + extra
    assert O.upper_cost(c, P.stage_table(c), free, True) is not None or extra < 40
    cost, sch = O.solve(c, free)
    assert sch is not None and cost == full_program(c, free, share=False)
    assert P.schedule_cost(P.stage_table(c), sch) == S.simulate(c, sch)[1] == cost


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
        fitted = PLANNERS["optimal"](chain, other.peak_bytes)
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


def test_measured_times_of_one_kind_are_averaged() -> None:
    """Timing noise must not make equal stages unique (the program solves equal sub-chains
    once): stages of one kind plan with their kind's mean time."""
    c = uniform_chain(12)  # stage 0 differs (nothing before it to free), so does the loss
    noisy = [1.0 + 0.01 * (s % 3) for s in range(11)] + [0.001]
    mean = noisy[:1] + [float(np.mean(noisy[1:11]))] * 10 + noisy[11:]
    assert O.kind_means(c, 1e9 * np.array(noisy)).tolist() == [round(1e9 * m) for m in mean]
    budget = c.base_bytes + P.least_need(P.Shape.of(P.stage_table(c), True)) + 30
    assert (PLANNERS["optimal"](c, budget, stage_time_s=noisy).schedule
            == PLANNERS["optimal"](c, budget, stage_time_s=mean).schedule)


@pytest.mark.parametrize("extra", [0, 5, 60])
def test_a_starting_cost_changes_nothing_where_the_search_probes(extra: int) -> None:
    """Near the least need the bound lies far below the optimum, so the search probes; a
    starting cost caps the probes' top level (``search``). From a cost below the optimum (no
    plan fits it), at it, or above, the program found is the one found without."""
    c = uniform_chain(60)
    shape = P.Shape.of(P.stage_table(c), True)
    free = P.least_need(shape) + extra
    plain = Q.search(shape, free)
    assert plain is not None
    best = plain.point(0, c.n - 1, 0, free)
    assert best is not None
    for upper in (int(c.f.sum()), best[0] - 1, best[0], best[0] + 1, 2 * best[0]):
        started = Q.search(shape, free, upper)
        assert started is not None
        assert started.point(0, c.n - 1, 0, free) == best
        assert started.schedule(0, c.n - 1, 0, free) == plain.schedule(0, c.n - 1, 0, free)
