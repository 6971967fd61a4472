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
identical sub-chains once, ``bounds`` prunes what no optimal plan can use; ``program`` holds
the stage table and the schedule read back, ``search`` the budgeted search (Alg. 3: the least
cost at a budget). This module is the planner: a budget, or the least peak without one, costs
in units, the plan. With ``slots``, memory is counted in slots instead, rounded against the
plan; with ``max_stages``, stages are first merged into groups (``coarse``).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import numpy.typing as npt

from memplan.core.budget import budget_too_small
from memplan.core.chain import Chain
from memplan.core.plan import Plan, make_plan
from memplan.core.planners import frontier as F
from memplan.core.planners.coarse import coarsen, expand
from memplan.core.planners.common import ChainLike, as_chain, int_param
from memplan.core.planners.program import Shape, least_need, schedule_cost, stage_table
from memplan.core.planners.repeats import stage_types
from memplan.core.planners.search import search
from memplan.core.schedule import Item, Region, plain_schedule, simulate
from memplan.errors import bad_arg

I64 = npt.NDArray[np.int64]
INF = float("inf")
COARSE_STAGES = 100  # the plan whose cost starts the exact search (``upper_cost``)
LEAST_PEAK_TOLERANCE = 1024  # without a budget: the least peak to 1/1024 of the plain one
MAX_NESTING = 100  # deeper plans recompute stages 100+ times; chain._run etc. recurse per level
COST_BITS = 18  # plan_optimal counts costs in units of 2**-18 of the forward (``cost_units``)
LEAST_PEAK_CACHED = 8  # least-peak schedules remembered (``least_peak_schedule``)
_least_peaks: dict[bytes, tuple[Item, ...]] = {}
_least_peaks_lock = threading.Lock()  # planning may run in threads: evictions must not race


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


def solve(c: Chain, avail_bytes: int, slots: int | None = None, slot_bytes: int | None = None,
          cost: I64 | None = None, allow_drop_cheap: bool = True
          ) -> tuple[float, tuple[Item, ...] | None]:
    """(forward cost executed, schedule) of the cheapest schedule fitting ``avail_bytes`` above
    the base; (inf, None) when none does. Exact in bytes unless ``slots`` (memory in that many
    slots of the budget) or ``slot_bytes`` is given."""
    if avail_bytes < 0:
        return INF, None
    slot = slot_bytes or (max(1, -(-avail_bytes // slots)) if slots else 1)
    shape = Shape.of(stage_table(c, cost, slot), allow_drop_cheap)
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
    shape = Shape.of(st, allow_drop_cheap)
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
    shape = Shape.of(stage_table(c), True)  # the proof capped by need (``search``)
    shape.fill(10, None, shape.relax(10, 1 << 20).caps(1 << 20))
