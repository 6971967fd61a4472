"""``optimal``: least recomputation under a peak budget: a rotor-style dynamic program
(Beaumont et al. 2019) over the chain model of ``memplan.chain``, with nested regions
(Sec. 4.4) and drop-cheap stages (Sec. 4.2) as choices, over every stage, exact to the byte.

C(s, t, m, dr): least forward cost executed to run stages s..t forward and backward with m
bytes free (input of s kept by the caller; dr: that input may be dropped once read):
  keep s:      f_s + C(s+1, t, m - xbar_s + dr*d_{s-1}, 1)
  drop-cheap:  f_s + fcheap_s + C(s+1, t, m - xsac_s, 1)        (top level only)
  region s..e: sum f_s..e + C(e+1, t, m - x_e, 1) + C(s, e, m, 0)
each where its own forward and backward fit (t = K-1: the top level; t < K-1: a region's
body). ``frontier`` holds every C(s, t, ., dr) as its exact frontier in m, ``repeats`` solves
identical sub-chains once, ``bounds`` prunes what no optimal plan can use. This module builds
the stage table, runs the budgeted search (Alg. 3: the least cost at a budget, or the least
peak) and rebuilds the schedule. With ``slots``, memory is counted in slots instead, rounded
against the plan; with ``max_stages``, stages are first merged into groups (``coarse``).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memplan.core.budget import budget_too_small
from memplan.core.chain import Chain
from memplan.core.plan import Plan, make_plan
from memplan.core.planners import frontier as F
from memplan.core.planners.body_bounds import fill_bounds, item_kinds
from memplan.core.planners.bounds import recompute_bounds
from memplan.core.planners.coarse import coarsen, expand
from memplan.core.planners.common import ChainLike, as_chain, int_param
from memplan.core.planners.priced import Relaxation, relax
from memplan.core.planners.repeats import classes, stage_types
from memplan.core.schedule import DropCheap, Item, Keep, Region, plain_schedule, simulate
from memplan.errors import bad_arg

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
F64 = npt.NDArray[np.float64]
INF = float("inf")
SLACK_START = 32  # the first search allows 1/32 of a forward pass above the lower bound
COARSE_STAGES = 100  # the plan whose cost starts the exact search (``upper_cost``)
LEAST_PEAK_TOLERANCE = 1024  # without a budget: the least peak to 1/1024 of the plain one
PROBE_TOP = 256  # a probe's top-level slack, in multiples of its bodies' (``search``)
# The proof's slack, in multiples of the probe's, from which it is capped by need
# (``priced``): that costs a forward program over the chain, tenths of a second on 1,000
# stages, and pays where the plain caps keep far more than the bounds allow (LSTM T=1024
# at 0.5 GB: 37 times, proof 1.68 -> 0.75 s); not where they keep little (ResNet-1000 at
# 3.8 GB, 1/32 of a forward pass: 5.5 times, 0.09 s plain, 0.14 s capped by need).
PRICED = 16
REPROBE = 4  # ``_priced_proof``: a probe's plan this many slacks above the root: probe again
MAX_NESTING = 100  # deeper plans recompute stages 100+ times; chain._run etc. recurse per level
COST_BITS = 18  # plan_optimal counts costs in units of 2**-18 of the forward (``cost_units``)
LEAST_PEAK_CACHED = 8  # least-peak schedules remembered (``least_peak_schedule``)
_least_peaks: dict[bytes, tuple[Item, ...]] = {}
_least_peaks_lock = threading.Lock()  # planning may run in threads: evictions must not race


def stage_table(c: Chain, cost: I64 | None = None, slot: int = 1) -> I64:
    """The program's per-stage values (rows ``frontier.COST`` ..), memory in units of ``slot``
    bytes rounded against the plan (sizes and needs up, the credit d_{s-1} down): exact at 1.
    ``cost``: per-stage forward cost (default FLOPs); drop-cheap's part scales with it."""
    f = c.f if cost is None else np.asarray(cost, dtype=np.int64)
    cheap = c.fcheap if cost is None else np.rint(f * (c.fcheap / np.maximum(c.f, 1)))

    def up(v: I64) -> I64:
        return -(-v // slot)

    gb = up(c.gb)
    nxt = np.maximum(np.maximum(c.tf, c.tf0), c.tf_sac)[1:]
    held = c.held_end
    exit_top = np.where(held > 0, c.x + held + np.append(nxt, 0), 0)  # ``region_exit``
    exit_top[-1] = 0
    rows = np.empty((F.ROWS, c.n), dtype=np.int64)
    for row, v in ((F.COST, f), (F.CHEAP, cheap), (F.X, up(c.x)), (F.XBAR, up(c.xbar)),
                   (F.DPREV, np.concatenate(([0], c.d[:-1])) // slot), (F.XSAC, up(c.xsac)),
                   (F.TF_TOP, up(c.tf)), (F.TF_IN, up(c.tf_replay)),
                   (F.NEED_B, up(c.xbar + c.tb) + gb),
                   (F.DC_NEED, up(np.maximum(c.tf_sac, c.need_sac_b))),
                   (F.TF0_TOP, up(c.tf0)), (F.TF0_IN, up(c.tf0_replay)),
                   (F.GF_IN, up(c.d) + gb), (F.GB, gb),
                   (F.EXIT_TOP, up(exit_top))):
        rows[row] = v
    return rows


@dataclass(frozen=True)
class _Shape:
    """What does not depend on the budget: the table and its classes of identical sub-chains."""

    st: I64
    cid: I32
    min_gb: I64
    allow_dc: bool

    @classmethod
    def of(cls, st: I64, allow_dc: bool, share: bool = True) -> _Shape:
        """``share``: solve identical sub-chains once (off: every stage its own kind)."""
        # What a sub-chain inside a region depends on, gradient bytes relative to its end.
        gb = st[F.GB]
        own = np.stack([st[F.COST], st[F.X], st[F.XBAR], st[F.DPREV], st[F.TF_IN],
                        st[F.TF0_IN], st[F.NEED_B] - gb, st[F.GF_IN] - gb])
        step = np.append(gb[:-1] - gb[1:], 0)  # to the next stage: not the last one's concern
        if share:
            kinds, end_kinds = stage_types(np.vstack([own, step])), stage_types(own)
        else:
            kinds = end_kinds = np.arange(st.shape[1], dtype=np.int64)
        cid, min_gb = classes(kinds, end_kinds, gb)
        return cls(st, cid, min_gb, allow_dc)

    def credit(self) -> int:
        """What the free bytes can grow by (inputs dropped once read, beyond what is kept)."""
        return int(np.maximum(self.st[F.DPREV] - self.st[F.XBAR], 0).sum())

    def fill(self, free: int, cost_caps: tuple[I64, int] | None,
             by_need: tuple[I64, I64] | None = None) -> _Program:
        """The program for ``free`` bytes; ``cost_caps``: (top-level caps, inner slack);
        ``by_need``: caps by free bytes for every row (``priced``)."""
        st = self.st
        mcap = min(free + self.credit(), F.BIG // 4)
        top, inner = cost_caps or (np.full(st.shape[1], F.BIG // 4, dtype=np.int64), F.BIG // 4)
        caps, ctab = by_need or (np.zeros((0, 3), np.int64), np.zeros((0, 2, 2), np.int64))
        pool, tab = F.fill(st, self.cid, mcap - self.min_gb, mcap, top, inner, self.allow_dc,
                           caps, ctab)
        return _Program(st, self.cid, len(self.min_gb), pool, tab)

    def relax(self, free: int, upper: int) -> Relaxation:
        """The priced relaxation among plans costing at most ``upper`` (``priced``)."""
        mcap = min(free + self.credit(), F.BIG // 4)
        bodies = fill_bounds(self.st, self.cid, mcap - self.min_gb, item_kinds(self.st))
        return relax(self.st, self.cid, bodies, free, self.credit(), upper, self.allow_dc)


@dataclass(frozen=True)
class _Program:
    """Filled frontiers, and the schedule read back from them."""

    st: I64
    cid: I32
    n_cls: int
    pool: I64
    tab: I64

    def point(self, s: int, t: int, dr: int, m: int) -> tuple[int, int] | None:
        """(cost, choice) of C(s, t, ., dr) at m; None: infeasible there."""
        row, base = F.ref(self.cid, self.st[F.GB], self.n_cls, s, t)
        off, n = int(self.tab[row, dr, 0]), int(self.tab[row, dr, 1])
        i = F.find(self.pool, off, n, m - base)
        return None if i < 0 else (int(self.pool[off + i, 1]), int(self.pool[off + i, 2]))

    def schedule(self, s: int, t: int, dr: int, m: int) -> tuple[Item, ...]:
        items: list[Item] = []
        while s <= t:
            hit = self.point(s, t, dr, m)
            assert hit is not None, "a frontier point refers to an infeasible one"
            choice = hit[1]
            if choice == F.KEEP:
                items.append(Keep(s))
                m -= int(self.st[F.XBAR, s] - dr * self.st[F.DPREV, s])
            elif choice == F.DROP_CHEAP:
                items.append(DropCheap(s))
                m -= int(self.st[F.XSAC, s])
            else:  # a region s..e: its body has m free too
                e = s + choice
                items.append(Region(s, e, self.schedule(s, e, 0, m)))
                m -= int(self.st[F.X, e])
                s = e
            s, dr = s + 1, 1
        return tuple(items)


def _cost_caps(shape: _Shape, bounds: tuple[float, F64], slack: int,
               top_slack: int | None = None) -> tuple[I64, int]:
    """Cost caps that keep every plan whose recomputation is within ``slack`` of the lower
    bound (``bounds``: ``recompute_bounds``): the suffix from s pays at most the rest of that
    after the prefix's own least recomputation; a region's body at most the slack beyond one
    replay. ``top_slack``: the suffixes' slack instead (a probe's, larger)."""
    cost = shape.st[F.COST]
    lb_total, lb_prefix = bounds
    margin = 1 + int(1e-9 * float(cost.sum()))  # the bounds are floats
    suffix = np.cumsum(cost[::-1])[::-1]
    top_slack = slack if top_slack is None else top_slack
    top = suffix + np.floor(lb_total - lb_prefix).astype(np.int64) + top_slack + margin
    return np.minimum(top, F.BIG // 4), min(slack + margin, F.BIG // 4)


def search(shape: _Shape, free: int, upper: int | None = None) -> _Program | None:
    """The program at ``free`` bytes whose root point is the optimum; None: nothing fits.
    Costs are capped at the lower bound plus a slack (the caps never cut a plan within
    them, so the first plan found within them is optimal). When the first two caps cut every
    plan, the bound is far below the optimum (it ignores nesting): probes look for a plan,
    their bodies' slack half the first caps' and doubled while none is found, their top
    level's ``PROBE_TOP`` times larger. Why: a fill's time grows with its bodies' slack far
    faster than with its top level's (LSTM T=1024 at 0.5 GB: bodies 1/64 of a forward pass,
    top 4, 0.08 s, finding the optimum; bodies 1/8, 0.5 s). A plan a probe finds is optimal
    if it lies within the bodies' slack (every plan that does is in the probe), else its cost
    is the slack of one last fill, which keeps it and so finds the optimum; capped by need
    where that slack is ``PRICED`` times the probe's or more (``_priced_proof``).
    ``upper``: the cost of a plan thought to fit; the first slack, and a probe's top-level
    slack, are at most what keeps it (smaller caps, a faster fill); if a fill that keeps it
    finds none, it does not fit and the search goes on without it."""
    k = shape.st.shape[1]
    forward = int(shape.st[F.COST].sum())
    total = forward + int(shape.st[F.CHEAP].sum())
    bounds = recompute_bounds(shape.st, free, shape.allow_dc)
    slack = max(1, forward // SLACK_START)
    # The slack that keeps the upper plan: no optimum costs more, so no probe needs more.
    ceiling = None if upper is None else max(1, upper - forward - int(bounds[0]) + 1)
    if ceiling is not None:
        slack = min(slack, ceiling)
    for caps in (slack, 2 * slack):  # mostly the bound is close: the optimum within these
        prog = shape.fill(free, _cost_caps(shape, bounds, caps))
        if prog.point(0, k - 1, 0, free) is not None:
            return prog
        if caps == slack and least_need(shape) > free:
            return None
        if ceiling is not None and caps >= ceiling:
            ceiling = None  # the upper plan does not fit after all
    inner = max(1, slack // 2)
    while True:
        unbounded = inner > (k + 1) * max(total, 1)
        top = PROBE_TOP * inner if ceiling is None else min(PROBE_TOP * inner,
                                                            max(inner, ceiling))
        prog = shape.fill(free, None if unbounded else _cost_caps(shape, bounds, inner, top))
        hit = prog.point(0, k - 1, 0, free)
        if hit is not None:
            over = hit[0] - forward - int(bounds[0])  # its recomputation above the bound
            if unbounded or over <= inner:
                return prog
            if over < PRICED * inner:  # the proof: every plan costing at most this one's
                return shape.fill(free, _cost_caps(shape, bounds, over))
            return _priced_proof(shape, free, bounds, prog, inner)
        if unbounded:
            return None
        if ceiling is not None and inner >= ceiling:
            ceiling = None  # the upper plan does not fit after all
        inner *= 2


def _priced_proof(shape: _Shape, free: int, bounds: tuple[float, F64], probe: _Program,
                  inner: int) -> _Program:
    """The proof of a probe's plan, capped by need (``priced``). Where that plan lies far
    above the relaxation's root (``REPROBE`` times the probe's bodies' slack), one more
    probe, its slack doubled under those caps, may find a cheaper one, whose caps are
    tighter (ResNet-1000 at its least peak: 0.45 of a forward pass above the bound at 1/64,
    0.25 at 1/32). A probe's plan within its bodies' slack is optimal."""
    k = shape.st.shape[1]
    forward = int(shape.st[F.COST].sum())
    cost = probe.point(0, k - 1, 0, free)[0]  # type: ignore[index]
    relaxed = shape.relax(free, cost)
    if cost - relaxed.root > REPROBE * inner:
        inner *= 2
        again = shape.fill(free, _cost_caps(shape, bounds, inner, PROBE_TOP * inner),
                           relaxed.caps(cost))
        hit = again.point(0, k - 1, 0, free)  # at most cost: the first plan is in it
        if hit is not None:
            cost = hit[0]
            if cost - forward - int(bounds[0]) <= inner:
                return again
    over = cost - forward - int(bounds[0])
    return shape.fill(free, _cost_caps(shape, bounds, over), relaxed.caps(cost))


def schedule_cost(st: I64, items: tuple[Item, ...]) -> int:
    """The program's cost of a schedule (every forward run, replays included)."""
    total = 0
    for it in items:
        if isinstance(it, Keep):
            total += int(st[F.COST, it.stage])
        elif isinstance(it, DropCheap):
            total += int(st[F.COST, it.stage] + st[F.CHEAP, it.stage])
        else:
            total += int(st[F.COST, it.start : it.end + 1].sum()) + schedule_cost(st, it.body)
    return total


def upper_cost(c: Chain, st: I64, avail_bytes: int, allow_dc: bool) -> int | None:
    """The cost (in ``st``'s units) of the plan of the chain merged into ``COARSE_STAGES``
    groups (``coarse``: a few milliseconds), which mostly fits ``avail_bytes`` too and costs
    a little more than the optimum: ``search`` starts from it. None: too short, or no fit."""
    if c.n <= COARSE_STAGES:
        return None
    coarse, groups = coarsen(c, COARSE_STAGES)
    group_cost = np.array([st[F.COST, a : b + 1].sum() for a, b in groups], dtype=np.int64)
    _, sch = solve(coarse, avail_bytes, cost=group_cost, allow_drop_cheap=allow_dc)
    return None if sch is None else schedule_cost(st, expand(sch, groups))


def least_need(shape: _Shape) -> int:
    """The fewest free bytes (units) any schedule needs (``frontier.BIG``: none fits)."""
    return int(F.least_need(shape.st, shape.cid, len(shape.min_gb), shape.allow_dc))


def solve(c: Chain, avail_bytes: int, slots: int | None = None, slot_bytes: int | None = None,
          cost: I64 | None = None, allow_drop_cheap: bool = True
          ) -> tuple[float, tuple[Item, ...] | None]:
    """(forward cost executed, schedule) of the cheapest schedule fitting ``avail_bytes`` above
    the base; (inf, None) when none does. Exact in bytes unless ``slots`` (memory in that many
    slots of the budget) or ``slot_bytes`` is given."""
    if avail_bytes < 0:
        return INF, None
    slot = slot_bytes or (max(1, -(-avail_bytes // slots)) if slots else 1)
    shape = _Shape.of(stage_table(c, cost, slot), allow_drop_cheap)
    free = avail_bytes // slot
    exact = slot == 1  # a plan that fits in bytes may not in slots
    upper = upper_cost(c, shape.st, avail_bytes, allow_drop_cheap) if exact else None
    prog = search(shape, free, upper)
    if prog is None:
        return INF, None
    hit = prog.point(0, c.n - 1, 0, free)
    assert hit is not None
    return float(hit[0]), prog.schedule(0, c.n - 1, 0, free)


def cost_units(c: Chain, cost: I64 | None) -> tuple[I64 | None, int]:
    """Per-stage costs (default FLOPs) in units of 1/2**COST_BITS of their sum, rounded, and
    the unit; (cost, 1) where the sum is below 2**(COST_BITS + 1) or the chain is short.
    Why: drop-cheap's own recomputation can be far below a stage's (an LSTM step's: 0.07 %),
    and counted exactly it splits every level of a top-level frontier into one point per
    number of drop-cheap stages (LSTM T=1024 at 3 GB: 1.08 M points, 2.4 s; in these units,
    where it rounds to 0: 0.7 s, the same plan cost to 3 decimals). A plan's true cost is
    then within half a unit per stage it runs of the exact optimum's, which also runs each of
    its stages at most that often.
    Chains of at most ``COARSE_STAGES`` stages plan fast exactly: counted exactly (ilp's MILP
    checks its plans against theirs on such chains, exact ties included)."""
    f = c.f if cost is None else cost
    unit = max(1, int(f.sum()) >> COST_BITS)
    if unit == 1 or c.n <= COARSE_STAGES:
        return cost, 1
    return np.rint(f / unit).astype(np.int64), unit


def kind_means(c: Chain, times_ns: npt.NDArray[np.float64]) -> I64:
    """Measured times averaged over stages of one kind (equal FLOPs and bytes, gradient bytes
    aside): timing noise would make every stage unique and cost the program its sharing of
    identical sub-chains (``repeats``). Whole nanoseconds."""
    st = stage_table(c)
    kinds = stage_types(np.delete(st, [F.NEED_B, F.GF_IN, F.GB], axis=0))
    mean = np.bincount(kinds, weights=times_ns) / np.bincount(kinds)
    return np.rint(mean[kinds]).astype(np.int64)


def least_peak_schedule(c: Chain, slots: int | None = None, cost: I64 | None = None,
                        allow_drop_cheap: bool = True) -> tuple[Item, ...]:
    """The cheapest schedule within ``LEAST_PEAK_TOLERANCE`` of the way from the least peak to
    the plain one above the least peak. Exactly at the least peak, a long chain of equal stages
    nests regions as deep as it is long (O(1) memory, O(K^2) recomputation: Sec. 4.4's end
    point); a hair above, a few levels do for a small fraction of the cost."""
    plain = int(simulate(c, plain_schedule(c))[0]) - c.base_bytes
    slot = max(1, -(-plain // slots)) if slots else 1
    st = stage_table(c, cost, slot)
    # The schedule depends on the table and these alone. A refused budget asks for it up to
    # three times (the budget's search, ``fit.least``, ilp's least peak on the same chain):
    # seconds each on a long chain, so the last few are remembered.
    key = hashlib.blake2b(np.ascontiguousarray(st).tobytes() + b"%d,%d,%d" % (
        st.shape[1], plain // slot, allow_drop_cheap), digest_size=20).digest()
    known = _least_peaks.get(key)
    if known is not None:
        return known
    shape = _Shape.of(st, allow_drop_cheap)
    need = least_need(shape) + plain // slot // LEAST_PEAK_TOLERANCE
    prog = search(shape, need)
    assert prog is not None  # above the least need
    found = prog.schedule(0, c.n - 1, 0, need)
    with _least_peaks_lock:
        while len(_least_peaks) >= LEAST_PEAK_CACHED:
            del _least_peaks[next(iter(_least_peaks))]
        _least_peaks[key] = found
    return found


def nesting(items: tuple[Item, ...]) -> int:
    """How deep recompute regions nest (the paper's largest mirror count m(v))."""
    deepest, stack = 0, [(items, 0)]
    while stack:
        seq, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((it.body, depth + 1) for it in seq if isinstance(it, Region))
    return deepest


def plan_optimal(graph: ChainLike, budget_bytes: int | None = None,
                 max_stages: int | None = None, slots: int | None = None,
                 drop_cheap: bool = True, stage_time_s: list[float] | None = None) -> Plan:
    """Least recomputation (FLOPs, or measured time with ``stage_time_s``) under the budget;
    without a budget, the least peak (to 1/1024 of the plain peak: ``least_peak_schedule``)
    and the least recomputation at it (on chains over ``COARSE_STAGES`` stages, costs in
    units of 2**-18 of the forward pass: ``cost_units``). Every stage, exact to the byte by
    default; ``max_stages`` merges stages into that many groups first and ``slots`` counts
    memory in that many slots of the budget (both faster, coarser). A budget whose cheapest
    plan nests regions deeper than ``MAX_NESTING`` (a hair above the least peak) is refused
    as too small: the least-peak plan's peak is what it asks for."""
    chain = as_chain(graph)
    if max_stages is not None:
        max_stages = int_param("max_stages", max_stages, 2, "Use e.g. max_stages=100, or None.")
    if slots is not None:
        slots = int_param("slots", slots, 8, "Use e.g. slots=4096, or None (exact bytes).")
    if stage_time_s is not None and len(stage_time_s) != chain.n:
        raise bad_arg("stage_time_s", f"{chain.n} forward times (one per stage)",
                      len(stage_time_s), "Measure each stage of this graph's chain.")
    coarse, groups = coarsen(chain, max_stages) if max_stages else (chain, [(s, s) for s in
                                                                           range(chain.n)])
    cost = None
    if stage_time_s is not None:  # nanoseconds, integers (then counted in units: cost_units)
        cost = kind_means(coarse, np.array([1e9 * sum(stage_time_s[a : b + 1])
                                            for a, b in groups]))
    params = {"max_stages": max_stages, "slots": slots, "drop_cheap": drop_cheap,
              "objective": "flops" if cost is None else "time"}
    notes: tuple[str, ...] = () if coarse is chain else (
        f"{chain.n} stages merged into {coarse.n} groups for speed (max_stages)",)
    cost, unit = cost_units(coarse, cost)
    if unit > 1:
        what = "FLOPs" if stage_time_s is None else "ns"
        note = (f"costs counted in units of {unit:,} {what} (1/{1 << COST_BITS} of the "
                "forward): the least recomputation to within half a unit per stage run")
        notes += (note,)

    def done(schedule: tuple[Item, ...], extra: tuple[str, ...] = ()) -> Plan:
        plan = make_plan(chain, schedule, "optimal", params, budget_bytes, notes + extra,
                         stage_time_s)  # predicted_time_s from the measured times, if any
        if budget_bytes is not None and plan.peak_bytes > budget_bytes:
            raise budget_too_small(budget_bytes, plan.peak_bytes, "optimal")
        return plan

    if budget_bytes is not None:
        _, sch = solve(coarse, budget_bytes - chain.base_bytes, slots, cost=cost,
                       allow_drop_cheap=drop_cheap)
        if sch is not None and nesting(sch) <= MAX_NESTING:
            return done(expand(sch, groups))
    least = make_plan(chain, expand(least_peak_schedule(coarse, slots, cost, drop_cheap),
                                    groups), "optimal", params, None)
    if budget_bytes is None:
        return done(least.schedule)
    if least.peak_bytes > budget_bytes:
        raise budget_too_small(budget_bytes, least.peak_bytes, "optimal")
    note = (f"the least-peak plan is returned: at this budget slot rounding finds none, or "
            f"the cheapest plan nests regions over {MAX_NESTING} deep")
    return done(least.schedule, (note,))


def warm_up() -> None:
    """Compile (and cache on disk) the program's kernels: numba compiles on first use, tens of
    seconds of CPU; ``make install`` calls this once so planning starts warm."""
    k = 3
    one = np.ones(k, dtype=np.int64)
    c = Chain("warm-up", np.arange(k), np.arange(k), ("m",) * k, f=one, b=one, x=one,
              xbar=2 * one, d=one, xsac=one, xsac_b=2 * one, fcheap=one, tf=one, tf0=one,
              tb=one, gb=one, base_bytes=0, step_flops=3 * k)
    solve(c, 10)
    least_peak_schedule(c)
    shape = _Shape.of(stage_table(c), True)  # the proof capped by need (``_priced_proof``)
    shape.fill(10, None, shape.relax(10, 1 << 20).caps(1 << 20))
