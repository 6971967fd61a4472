"""``ilp``: the least-recompute schedule as a MILP solved by HiGHS (``scipy.optimize.milp``),
for graphs whose clean chain loses too much: long skips (a U-Net's encoder outputs, read by
its decoder) make most cut points unusable as clean chain boundaries (Sec. 4.3), so the ILP
plans over a chain through *every* cut point of the graph. Values live across a cut made
before the stage that reads them (a skip) are then counted again by each region or
drop-cheap stage they pass through: the chain model over-counts there (on a U-Net run with
``memplan.apply`` the real peak is 0-11% below the prediction, never above: tests/test_ilp.py),
and ``simulate`` evaluates exactly the model solved here.

The program (``ilp_model``) is exact for that model, in bytes, over schedules of regions
nested at most ``max_depth`` deep. HiGHS takes no starting solution through scipy, so the
``optimal`` dynamic program's plan for the same chain is computed as well and returned when
the MILP does not beat it within its node limit. The result is deterministic: HiGHS stops at
``node_limit`` nodes, a work limit (``plan.notes`` say whether it proved its plan optimal).
There is no wall-clock limit unless the caller sets ``time_limit_s``; a search that limit
stops is not used, and the notes then say the plan depends on the machine (measured here: 100
stages of ResNet-1000 reach 5000 nodes in 39-108 s CPU). Chains longer than ``max_stages``
(default 100) are planned by the dynamic program alone: it is exact on the whole chain at
every nesting depth, so a MILP over merged groups could only lose to it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from memplan.core import chain as C
from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.budget import budget_too_small
from memplan.core.plan import Plan, make_plan
from memplan.core.planners.common import ALL_CUTS, ChainLike, int_param
from memplan.core.planners.ilp_model import build, objective, schedule, unit
from memplan.core.planners.optimal import plan_optimal
from memplan.errors import BudgetTooSmall, bad_arg

CUTS = ("auto", "all", "clean")
NODE_LIMIT = 5000  # branch-and-bound nodes: a work limit, the same on every machine


def ilp_chain(graph: ChainLike, cuts: str = "auto", max_stages: int = 100) -> C.Chain:
    """The chain the ILP plans over: a Chain as given; for a Graph, the chain through all its
    cut points (``cuts='all'``, or 'auto' when there are at most ``max_stages``), else the
    clean chain (``'clean'``)."""
    if cuts not in CUTS:
        raise bad_arg("cuts", f"one of {list(CUTS)}", cuts, "Use cuts='auto' (the default).")
    if isinstance(graph, C.Chain):
        return graph
    if not isinstance(graph, g.Graph):
        raise bad_arg("graph", "a memplan Graph or Chain", type(graph).__name__,
                      "Capture one with memplan.capture(...).")
    n_cuts = len(graph.cut_points)
    if cuts == "all" or (cuts == "auto" and n_cuts <= max_stages):
        return C.build_chain(graph, list(range(n_cuts)))
    return C.build_chain(graph)


@dataclass(frozen=True)
class MilpResult:
    schedule: tuple[S.Item, ...] | None
    proven: bool  # optimal within the model (HiGHS status 0)
    gap: float | None
    message: str
    retries: int = 0  # solves again after a plan over budget by solver tolerance
    timed_out: bool = False  # stopped by the caller's time limit: machine-dependent, not used
    objective: float | None = None  # the program's objective at the schedule (its own scale)


def solve_milp(c: C.Chain, budget_bytes: int | None, max_depth: int = 2,
               node_limit: int = NODE_LIMIT, drop_cheap: bool = True,
               cost: np.ndarray | None = None, time_limit_s: float | None = None
               ) -> MilpResult:
    """The cheapest schedule (regions nested at most ``max_depth`` deep) whose simulated peak
    fits ``budget_bytes``; with None, the least peak. HiGHS stops at ``node_limit``
    branch-and-bound nodes: a work limit, so the result is the same on any machine under any
    load. ``time_limit_s`` (none by default) makes it machine-dependent: a search it stops is
    reported and not used.
    Every returned schedule is checked with ``simulate``; one over budget by solver tolerance
    is solved again with a tighter budget.
    HiGHS (scipy 1.17) can report a worse point as optimal, or a feasible program as
    infeasible, with its MIP presolve (ERGO-Code/HiGHS#3094, #3073: on a 4-stage chain 10
    FLOPs of recomputation where 7 fit) and without it (test_ilp.py: 6 where 5 fit; a 5-stage
    chain called infeasible). So it solves both ways and keeps the better schedule, at twice
    the MILP's time."""
    depth = max(0, min(max_depth, c.n - 1))
    cost = (c.f if cost is None else np.asarray(cost)).astype(np.float64)
    best: MilpResult | None = None
    for presolve in (False, True):
        res = _solve(c, budget_bytes, depth, node_limit, drop_cheap, cost, time_limit_s,
                     presolve)
        if res.timed_out:
            return res
        if best is None or _better(res, best):
            best = res
    assert best is not None
    return best


def _better(res: MilpResult, than: MilpResult) -> bool:
    """Whether ``res`` has a schedule and ``than`` none, or its objective is lower (the
    program's own: executed cost at a budget, the peak without one)."""
    if res.schedule is None or res.objective is None:
        return False
    if than.schedule is None or than.objective is None:
        return True
    return res.objective < than.objective - 1e-9  # ties: the first solve's


def _solve(c: C.Chain, budget_bytes: int | None, depth: int, node_limit: int,
           drop_cheap: bool, cost: np.ndarray, time_limit_s: float | None, presolve: bool
           ) -> MilpResult:
    """One HiGHS solve of the program (``solve_milp``), and its retries over budget."""
    # scipy (HiGHS) loads only when a MILP is solved: importing the planners stays fast
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    target = budget_bytes
    options: dict[str, Any] = {"node_limit": node_limit, "mip_rel_gap": 0.0,
                               "presolve": presolve}
    if time_limit_s is not None:
        options["time_limit"] = time_limit_s
    for retry in range(4):
        m, v, peak_var = build(c, target, depth, drop_cheap)
        a = coo_array((m.vals, (m.rows, m.cols)), shape=(len(m.lo), len(m.lb))).tocsr()
        res = milp(objective(c, m, v, cost, peak_var), integrality=np.array(m.integer),
                   bounds=Bounds(np.array(m.lb), np.array(m.ub)),
                   constraints=LinearConstraint(a, np.array(m.lo), np.array(m.hi)),
                   options=options)
        if "time limit" in str(res.message).lower():
            return MilpResult(None, False, None, str(res.message), retry, timed_out=True)
        if res.x is None:
            return MilpResult(None, res.status == 2, None, str(res.message), retry)
        sch = schedule(v, np.asarray(res.x), c.n, depth)
        peak = S.simulate(c, sch)[0]
        if budget_bytes is None or peak <= budget_bytes:
            gap = None if res.mip_gap is None else float(res.mip_gap)
            return MilpResult(sch, res.status == 0, gap, str(res.message), retry,
                              objective=float(res.fun))
        target = (target or budget_bytes) - (peak - budget_bytes) - unit(c)
    return MilpResult(None, False, None, "solver tolerance: no schedule within budget", 4)


def plan_ilp(graph: ChainLike, budget_bytes: int | None = None,
             time_limit_s: float | None = None,
             max_depth: int = 2, cuts: str = "auto", max_stages: int = 100,
             drop_cheap: bool = True, stage_time_s: list[float] | None = None,
             node_limit: int = NODE_LIMIT) -> Plan:
    """Least recomputation (FLOPs, or measured time with ``stage_time_s``, one per stage of
    ``ilp_chain(graph, cuts, max_stages)``) under the budget, by MILP; without a budget, the
    dynamic program's least-peak plan on that chain (``_least_peak_of_dp``). The 'optimal'
    dynamic program is exact on the same chain (every nesting depth): the MILP can only match
    it, so it runs on chains of at most ``max_stages`` stages (as a check; the DP's plan wins
    ties) and ``plan.notes`` say which plan is returned and why. Deterministic: HiGHS stops
    at ``node_limit`` nodes. With ``time_limit_s`` (seconds of wall clock, none by default) a
    search it stops is not used and the notes say so: the notes, not the schedule, then depend
    on the machine."""
    max_depth, max_stages, node_limit = _checked(max_depth, max_stages, node_limit,
                                                 time_limit_s)
    chain = ilp_chain(graph, cuts, max_stages)
    if stage_time_s is not None and len(stage_time_s) != chain.n:
        raise bad_arg("stage_time_s", f"{chain.n} forward times (one per stage of the ILP's "
                      "chain, see planners.ilp.ilp_chain)", len(stage_time_s),
                      "Measure each stage of that chain (memplan.timing.stage_times).")
    out = _Out(chain, budget_bytes, stage_time_s, {
        "max_depth": max_depth, "cuts": cuts, "max_stages": max_stages,
        "drop_cheap": drop_cheap, "node_limit": node_limit,
        "objective": "flops" if stage_time_s is None else "time"}, (_chain_note(graph, chain),))
    try:  # the dynamic program's plan: exact on this chain, the one to beat
        dp: Plan | None = plan_optimal(chain, budget_bytes, drop_cheap=drop_cheap,
                                       stage_time_s=stage_time_s)
    except BudgetTooSmall:
        dp = None
    if chain.n > max_stages:
        if dp is None:
            raise budget_too_small(budget_bytes or 0, plan_optimal(
                chain, None, drop_cheap=drop_cheap, stage_time_s=stage_time_s).peak_bytes, "ilp")
        return out.wrap(dp.schedule, (
            f"{chain.n} stages, over max_stages={max_stages}: a MILP over merged groups cannot "
            f"beat the 'optimal' dynamic program, exact on all {chain.n} stages at every "
            "nesting depth; its plan is returned"))
    if budget_bytes is None and dp is not None:
        return _least_peak_of_dp(graph, out, dp, drop_cheap, stage_time_s)
    cost = None if stage_time_s is None else np.asarray(stage_time_s, dtype=np.float64)
    res = solve_milp(chain, budget_bytes, max_depth, node_limit, drop_cheap, cost,
                     time_limit_s)
    status = _status(res, max_depth, node_limit)
    mine = None if res.schedule is None else out.wrap(res.schedule, status)
    found = _other_dp(graph, chain, budget_bytes, drop_cheap, stage_time_s)
    if found is not None and all(_key(found[0], budget_bytes) < _key(p, budget_bytes)
                                 for p in (mine, dp) if p is not None):
        other, which = found
        note = (f"{status}; the 'optimal' dynamic program's plan on {which} "
                f"({len(other.stages)} stages) is better and returned")
        return dataclasses.replace(other, planner="ilp", params=out.params,
                                   notes=(*out.notes, note))
    if dp is not None and (mine is None or _key(dp, budget_bytes) <= _key(mine, budget_bytes)):
        why = "no better" if mine is not None else "no plan"
        return out.wrap(dp.schedule, f"{status}; it found {why} than the 'optimal' "
                        "dynamic program (exact on this chain), whose plan is returned")
    if mine is None:  # nothing found at the budget: the least peak says why
        return _least_peak(out, status, time_limit_s, max_depth, cuts, max_stages,
                           drop_cheap, node_limit)
    if budget_bytes is not None and mine.peak_bytes > budget_bytes:  # never: checked above
        raise budget_too_small(budget_bytes, mine.peak_bytes, "ilp")
    return mine


def _checked(max_depth: int, max_stages: int, node_limit: int, time_limit_s: float | None
             ) -> tuple[int, int, int]:
    max_depth = int_param("max_depth", max_depth, 0, "Use e.g. max_depth=2.")
    max_stages = int_param("max_stages", max_stages, 2, "Use e.g. max_stages=100.")
    node_limit = int_param("node_limit", node_limit, 1, f"Use e.g. node_limit={NODE_LIMIT}.")
    if time_limit_s is not None and (isinstance(time_limit_s, bool) or not isinstance(
            time_limit_s, (int, float)) or not time_limit_s > 0):
        raise bad_arg("time_limit_s", "seconds > 0, or None (no wall-clock limit: the default, "
                      "deterministic)", time_limit_s,
                      "Leave it out, or lower node_limit for a faster, still deterministic "
                      "search.")
    return max_depth, max_stages, node_limit


@dataclass(frozen=True)
class _Out:
    """What every plan ``plan_ilp`` returns shares: its chain, budget, params and notes."""

    chain: C.Chain
    budget_bytes: int | None
    stage_time_s: list[float] | None
    params: dict[str, Any]
    notes: tuple[str, ...]

    def wrap(self, sch: tuple[S.Item, ...], extra: str) -> Plan:
        return make_plan(self.chain, sch, "ilp", self.params, self.budget_bytes,
                         (*self.notes, extra), self.stage_time_s)


def _chain_note(graph: ChainLike, chain: C.Chain) -> str:
    if isinstance(graph, C.Chain):
        return f"chain of {chain.n} stages"
    every = chain.n == len(graph.cut_points)  # cuts='auto' takes the clean chain over max_stages
    return f"chain of {chain.n} stages through {'all' if every else 'clean'} cut points"


def _status(res: MilpResult, max_depth: int, node_limit: int) -> str:
    """How the MILP's search ended, for ``plan.notes``."""
    return (f"MILP (HiGHS, regions nested <= {max_depth} deep): "
            + ("not used: stopped by time_limit_s before its node limit (a wall-clock "
               "limit: these notes depend on the machine; leave it out for a deterministic "
               "search)" if res.timed_out else "proven optimal" if res.proven else
               f"node limit {node_limit} reached, gap "
               f"{'unknown' if res.gap is None else f'{res.gap:.2%}'}"))


def _least_peak_of_dp(graph: ChainLike, out: _Out, dp: Plan, drop_cheap: bool,
                      stage_time_s: list[float] | None) -> Plan:
    """Without a budget, the dynamic program's least-peak plan on the ILP's chain (or on the
    graph's other chain when lower, ``_other_dp``): it lies within 1/1024 of the plain peak
    above the least peak of any schedule at any depth (``optimal.least_peak_schedule``),
    which a MILP over schedules nested <= max_depth deep cannot go below. The MILP is not
    run: on 36 stages it spent 32 s CPU at its node limit to find a higher peak than this
    plan's."""
    found = _other_dp(graph, out.chain, None, drop_cheap, stage_time_s)
    why = ("the least peak: the 'optimal' dynamic program's least-peak plan (within 1/1024 of "
           "the plain peak above the least peak of any schedule, every nesting depth: a MILP "
           "cannot go below it by more), not searched again by MILP")
    if found is not None and _key(found[0], None) < _key(dp, None):
        other, which = found
        note = f"{why}; on {which} ({len(other.stages)} stages) it is lower and returned"
        return dataclasses.replace(other, planner="ilp", params=out.params,
                                   notes=(*out.notes, note))
    return out.wrap(dp.schedule, why)


def _least_peak(out: _Out, status: str, time_limit_s: float | None, max_depth: int, cuts: str,
                max_stages: int, drop_cheap: bool, node_limit: int) -> Plan:
    """No plan at the budget: the least-peak plan when it fits after all, else BudgetTooSmall
    with the least peak."""
    if out.budget_bytes is None:
        raise budget_too_small(0, 0, "ilp")  # unreachable: keep-all always fits no budget
    least = plan_ilp(out.chain, None, time_limit_s, max_depth, cuts, max_stages, drop_cheap,
                     out.stage_time_s, node_limit)
    if least.peak_bytes > out.budget_bytes:
        raise budget_too_small(out.budget_bytes, least.peak_bytes, "ilp")
    return out.wrap(least.schedule, f"{status} at the budget; the least-peak plan is returned")


def _other_dp(graph: ChainLike, chain: C.Chain, budget_bytes: int | None, drop_cheap: bool,
              stage_time_s: list[float] | None) -> tuple[Plan, str] | None:
    """The dynamic program's plan on the graph's other chain, and which chain that is: the
    clean chain where the ILP plans over every cut point (there it can beat the skips'
    over-count), or the chain through every cut point where the ILP plans over the clean
    one, there being more than ``max_stages`` (up to ``ALL_CUTS``, as ``optimal`` plans: a
    Mamba layer's scan has no clean cut inside, and cutting inside it lowers the peak)."""
    if not isinstance(graph, g.Graph) or stage_time_s is not None:
        return None
    other, which = C.build_chain(graph), "the clean chain"
    if np.array_equal(other.last, chain.last):
        n_cuts = len(graph.cut_points)
        if not other.n < n_cuts <= ALL_CUTS:
            return None
        other = C.build_chain(graph, list(range(n_cuts)))
        which = "the chain through every cut point"
    try:
        return plan_optimal(other, budget_bytes, drop_cheap=drop_cheap), which
    except BudgetTooSmall:
        return None


def _key(p: Plan, budget_bytes: int | None) -> tuple[float, float]:
    """What the plan is judged by: cost (time when measured), then peak; or the reverse."""
    cost = float(p.extra_flops if p.predicted_time_s is None else p.predicted_time_s)
    return (cost, p.peak_bytes) if budget_bytes is not None else (p.peak_bytes, cost)
