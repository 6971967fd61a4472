"""``ilp``: the least-recompute schedule as a MILP solved by HiGHS (``scipy.optimize.milp``),
for graphs whose clean chain loses too much: long skips (a U-Net's encoder outputs, read by
its decoder) make most cut points unusable as clean chain boundaries (Sec. 4.3), so the ILP
plans over a chain through *every* cut point of the graph. Values live across a cut made
before the stage that reads them (a skip) are then counted again by each region or
drop-cheap stage they pass through: the chain model over-counts there (on a U-Net run with
``memplan.apply`` the real peak is 0-11% below the prediction, never above: tests/test_ilp.py),
and ``simulate`` evaluates exactly the model solved here.

The program is exact for that model, in bytes (no memory slots), over schedules of keep /
drop-cheap stages and recompute regions nested at most ``max_depth`` deep (Sec. 4.4;
the paper's mirror count m(v) is the depth). Per stage k and level l = 1..L, binaries
``in[l,k]`` (k is inside a level-l region), ``a[l,k]``/``z[l,k]`` (one starts/ends at k) and
``c[k]`` (drop-cheap); continuous ``W[l,k]``: bytes resident before k in its level-l
sequence, and ``G[l,k]``: the gradient bytes of the end of its level-l region. They follow
``chain._run`` item by item:

  W[0,k+1] = W[0,k] + keep: xbar_k - d_{k-1} | drop-cheap: xsac_k | region end: x_k
  W[l,k]   = W[l-1,k] at a level-l start, else W[l,k-1] + the same for level l
  peak    >= W + tf_k (+ G), W + xbar_k - d_{k-1} + gb_k + tb_k, W + need_sac_b_k,
             and for a region's first forward W + (G) + tf0_k + x_{k-1} (inside a region,
             the replay transients tfr_k, tfr0_k; a drop-cheap forward, tfs_k)

the top level's as exact rows (a stage is kept, drop-cheap or in a region), the others as
big-M rows whose M is the row's own range (``_Model.le_big``). The objective is the executed
forward cost: sum_k cost_k * depth_k + drop-cheap's recomputed ops. HiGHS takes no
starting solution through scipy, so the ``optimal`` dynamic program's plan for the same chain
is computed as well and returned when the MILP does not beat it within ``time_limit_s``.
The result is deterministic when HiGHS finishes within the limit (``plan.notes`` say so);
a search cut off by the limit returns what this machine found in that time. Chains longer
than ``max_stages`` (default 100) are merged into groups first, as ``optimal`` does: on
ResNet-1000's 341 stages HiGHS finds no plan in 10 s at tight budgets, on 100 groups it does
at moderate ones (benchmarks/planners.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from memplan.core import chain as C
from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.budget import budget_too_small
from memplan.core.plan import Plan, make_plan
from memplan.core.planners.common import ChainLike, int_param
from memplan.core.planners.optimal import plan_optimal
from memplan.errors import BudgetTooSmall, bad_arg

CUTS = ("auto", "all", "clean")
NODE_LIMIT = 5000  # branch-and-bound nodes: a work limit, the same on every machine
SAFETY_S = 600.0  # a wall-clock net only; a search it stops is not used
Terms = list[tuple[int, float]]


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


@dataclass
class _Model:
    """Columns (bounds, integrality, cost) and rows lo <= A x <= hi, built row by row."""

    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    lo: list[float] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)

    def var(self, n: int, lb: float, ub: float, integer: bool) -> list[int]:
        first = len(self.lb)
        self.lb += [lb] * n
        self.ub += [ub] * n
        self.integer += [int(integer)] * n
        return list(range(first, first + n))

    def row(self, terms: Terms, lo: float, hi: float) -> None:
        r = len(self.lo)
        for col, val in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(lo)
        self.hi.append(hi)

    def le_big(self, terms: Terms, rhs: float, ind: Terms | None = None,
               ind_const: float = 0.0) -> None:
        """sum(terms) <= rhs, enforced only where the indicator ind_const + sum(ind) is 0
        (it is a 0/1 expression). The big M is the row's largest left side over the bounds,
        so it never cuts off a true schedule, and rows that can never bind are dropped."""
        top = sum(v * (self.ub[c] if v > 0 else self.lb[c]) for c, v in terms)
        big = top - rhs
        if big <= 0:
            return
        if not ind and not ind_const:
            self.row(terms, -math.inf, rhs)
            return
        self.row(terms + [(c, -big * v) for c, v in ind or []], -math.inf, rhs + big * ind_const)


@dataclass(frozen=True)
class MilpResult:
    schedule: tuple[S.Item, ...] | None
    proven: bool  # optimal within the model (HiGHS status 0)
    gap: float | None
    message: str
    retries: int = 0  # solves again after a plan over budget by solver tolerance
    timed_out: bool = False  # stopped by the safety time limit: machine-dependent, not used


def _unit(c: C.Chain) -> int:
    """Bytes per model unit: a power of two bringing the largest byte count near 1e6."""
    top = float(c.base_bytes + np.abs(c.xbar).sum() + np.abs(c.xsac).sum() + np.abs(c.x).sum())
    return 1 << max(0, math.ceil(math.log2(max(top, 1.0) / 1e6)))


def _build(c: C.Chain, budget_bytes: int | None, depth: int, drop_cheap: bool
           ) -> tuple[_Model, dict[str, list[list[int]]], int | None]:
    k_n, u = c.n, _unit(c)
    if (c.tf0 < 0).any() or (c.x < 0).any():  # byte counts: the top-level rows rely on it
        raise bad_arg("chain", "tf0 and x >= 0 (bytes)", "negative values",
                      "Build the chain with memplan.chain.build_chain(graph).")
    z = [0.0]
    x, xbar, xsac = c.x / u, c.xbar / u, c.xsac / u
    dprev = np.concatenate((z, c.d[:-1] / u))
    tf, tf0 = c.tf / u, c.tf0 / u
    gb = (c.gb + c.d) / u  # gradient bytes when a region ending there replays (chain._run)
    # Inside regions the runtime replays (chain.Chain.tf_replay, tf0_replay).
    tfr, tfr0, tfs = c.tf_replay / u, c.tf0_replay / u, c.tf_sac / u
    back_keep = (c.xbar + c.gb + c.tb) / u - dprev
    back_cheap = c.need_sac_b / u
    base = c.base_bytes / u
    w_hi = base + float(np.maximum.reduce([x, xbar, xsac, np.zeros(k_n)]).sum())
    w_lo = base - float(dprev.sum())
    m = _Model()
    levels = range(1, depth + 1)
    v: dict[str, list[list[int]]] = {"c": [m.var(k_n, 0, 1.0 if drop_cheap else 0.0, True)]}
    for name, lb, ub, integer in (("in", 0, 1, True), ("a", 0, 1, True), ("z", 0, 1, True),
                                  ("ka", 0, 1, False), ("G", float(gb.min()), float(gb.max()),
                                                        False)):
        v[name] = [[]] + [m.var(k_n, lb, ub, integer) for _ in levels]
    v["W"] = [m.var(k_n, w_lo, w_hi, False) for _ in range(depth + 1)]
    m.lb[v["W"][0][0]] = m.ub[v["W"][0][0]] = base
    for lv in levels:  # the last stage ends every sequence: never in a region (validate)
        for name in ("in", "a", "z"):
            m.ub[v[name][lv][k_n - 1]] = 0.0
    peak_var = None if budget_bytes is not None else m.var(1, base, math.inf, False)[0]
    rhs = 0.0 if budget_bytes is None else budget_bytes / u
    peak: Terms = [] if peak_var is None else [(peak_var, -1.0)]
    cv, inn, a, zz, ka, gg, w = (v[n] for n in ("c", "in", "a", "z", "ka", "G", "W"))

    def at(name: str, lv: int, k: int) -> list[int]:
        """The variable, or nothing for level depth + 1 (never a region)."""
        return [v[name][lv][k]] if 1 <= lv <= depth else []

    for k in range(k_n):
        m.le_big([(cv[0][k], 1.0)] + [(i, 1.0) for i in at("in", 1, k)], 1.0)
        for lv in levels:
            m.row([(a[lv][k], 1.0), (inn[lv][k], -1.0)], -math.inf, 0.0)
            m.row([(zz[lv][k], 1.0), (inn[lv][k], -1.0)], -math.inf, 0.0)
            cont = [(inn[lv][k - 1], -1.0), (zz[lv][k - 1], 1.0)] if k else []
            m.row([(inn[lv][k], 1.0), (a[lv][k], -1.0)] + cont, 0.0, 0.0)
            if lv < depth:  # an inner region sits inside and never ends its sequence
                m.row([(inn[lv + 1][k], 1.0), (inn[lv][k], -1.0)], -math.inf, 0.0)
                m.row([(inn[lv + 1][k], 1.0), (zz[lv][k], 1.0)], -math.inf, 1.0)
                m.row([(a[lv][k], 1.0), (inn[lv + 1][k], 1.0), (a[lv + 1][k], -1.0)],
                      -math.inf, 1.0)
            keep = [(inn[lv][k], 1.0)] + [(i, -1.0) for i in at("in", lv + 1, k)]
            m.row(keep + [(a[lv][k], 1.0), (ka[lv][k], -1.0)], -math.inf, 1.0)
        # Top level: W[0, k+1] from W[0, k].
        if k + 1 < k_n:
            step = float(xbar[k] - dprev[k])
            terms = [(w[0][k], 1.0), (w[0][k + 1], -1.0), (cv[0][k], float(xsac[k]) - step)]
            terms += [(i, -step) for i in at("in", 1, k)] + [(i, float(x[k])) for i in at("z", 1, k)]
            m.row(terms, -math.inf, -step)
            exit_k = S.region_exit(c, k) / u - float(x[k])  # beyond W[0, k+1], which holds x_k
            if exit_k > 0 and depth:  # a top-level region ending at k: the next forward
                m.le_big([(w[0][k + 1], 1.0)] + peak, rhs - exit_k,
                         [(i, -1.0) for i in at("z", 1, k)], 1.0)
        for lv in levels:
            m.le_big([(w[lv - 1][k], 1.0), (w[lv][k], -1.0)], 0.0, [(a[lv][k], -1.0)], 1.0)
            if k:
                j, step = k - 1, float(xbar[k - 1] - dprev[k - 1])
                terms = [(w[lv][j], 1.0), (w[lv][k], -1.0), (inn[lv][j], step),
                         (ka[lv][j], float(dprev[j]))]
                terms += [(i, -step) for i in at("in", lv + 1, j)]
                terms += [(i, float(x[j])) for i in at("z", lv + 1, j)]
                m.le_big(terms, 0.0, [(inn[lv][k], -1.0), (a[lv][k], 1.0)], 1.0)
            m.le_big([(gg[lv][k], -1.0)], -float(gb[k]), [(zz[lv][k], -1.0)], 1.0)
            if k + 1 < k_n:
                m.le_big([(gg[lv][k + 1], 1.0), (gg[lv][k], -1.0)], 0.0,
                         [(inn[lv][k], -1.0), (zz[lv][k], 1.0)], 1.0)
        # Peaks at the top level, exact without a big M: a stage is kept, drop-cheap or in a
        # region, and a region's first forward (W + tf0_k (+ x_{k-1}) <= peak) bounds W there.
        xin = float(x[k - 1]) if k else 0.0
        in1, a1 = at("in", 1, k), at("a", 1, k)
        fwd = [(i, float(tf0[k] + xin - tf[k])) for i in in1] + [(i, -xin) for i in a1]
        fwd += [(cv[0][k], float(tfs[k] - tf[k]))] if drop_cheap else []
        m.le_big([(w[0][k], 1.0)] + peak + fwd, rhs - float(tf[k]))
        back = [(i, float(tf0[k] - back_keep[k])) for i in in1]
        back += [(cv[0][k], float(back_cheap[k] - back_keep[k]))] if drop_cheap else []
        m.le_big([(w[0][k], 1.0)] + peak + back, rhs - float(back_keep[k]))
        for lv in levels:
            not_keep = [(inn[lv][k], -1.0)] + [(i, 1.0) for i in at("in", lv + 1, k)]
            m.le_big([(w[lv][k], 1.0), (gg[lv][k], 1.0)] + peak, rhs - float(tfr[k]), not_keep,
                     1.0)
            m.le_big([(w[lv][k], 1.0), (ka[lv][k], float(dprev[k]))] + peak,
                     rhs - float(back_keep[k]), not_keep, 1.0)
        for lv in range(1, depth):  # a level lv+1 region's first forward, nothing saved
            terms = [(w[lv][k], 1.0)] + ([(gg[lv][k], 1.0)] if lv else []) + peak
            terms += [(a[lv + 1][k], -xin)] if xin else []
            m.le_big(terms, rhs - float(tfr0[k]) - xin, [(inn[lv + 1][k], -1.0)], 1.0)
    return m, v, peak_var


def _objective(c: C.Chain, m: _Model, v: dict[str, list[list[int]]], cost: np.ndarray,
               peak_var: int | None) -> np.ndarray:
    obj = np.zeros(len(m.lb))
    if peak_var is not None:
        obj[peak_var] = 1.0
        return obj
    scale = max(float(np.abs(cost).sum()), 1e-300)
    cheap = cost * (c.fcheap / np.maximum(c.f, 1))
    obj[v["c"][0]] = cheap / scale
    for ids in v["in"][1:]:
        obj[ids] = cost / scale
    return obj


def _schedule(v: dict[str, list[list[int]]], sol: np.ndarray, k_n: int, depth: int
              ) -> tuple[S.Item, ...]:
    on = sol > 0.5

    def seq(lo: int, hi: int, lv: int) -> tuple[S.Item, ...]:
        items: list[S.Item] = []
        k = lo
        while k <= hi:
            if lv < depth and on[v["in"][lv + 1][k]]:
                e = k
                while e < hi and not on[v["z"][lv + 1][e]]:
                    e += 1
                items.append(S.Region(k, e, seq(k, e, lv + 1)))
                k = e + 1
                continue
            items.append(S.DropCheap(k) if lv == 0 and on[v["c"][0][k]] else S.Keep(k))
            k += 1
        return tuple(items)

    return seq(0, k_n - 1, 0)


def solve_milp(c: C.Chain, budget_bytes: int | None, max_depth: int = 2,
               node_limit: int = NODE_LIMIT, drop_cheap: bool = True,
               cost: np.ndarray | None = None, time_limit_s: float = SAFETY_S) -> MilpResult:
    """The cheapest schedule (regions nested at most ``max_depth`` deep) whose simulated peak
    fits ``budget_bytes``; with None, the least peak. HiGHS stops at ``node_limit``
    branch-and-bound nodes: a work limit, so the result is the same on any machine under any
    load. ``time_limit_s`` is only a safety net; a search it stops is reported and not used.
    Every returned schedule is checked with ``simulate``; one over budget by solver tolerance
    is solved again with a tighter budget."""
    # scipy (HiGHS) loads only when a MILP is solved: importing the planners stays fast
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    depth = max(0, min(max_depth, c.n - 1))
    cost = (c.f if cost is None else np.asarray(cost)).astype(np.float64)
    target = budget_bytes
    for retry in range(4):
        m, v, peak_var = _build(c, target, depth, drop_cheap)
        a = coo_array((m.vals, (m.rows, m.cols)), shape=(len(m.lo), len(m.lb))).tocsr()
        res = milp(_objective(c, m, v, cost, peak_var), integrality=np.array(m.integer),
                   bounds=Bounds(np.array(m.lb), np.array(m.ub)),
                   constraints=LinearConstraint(a, np.array(m.lo), np.array(m.hi)),
                   options={"node_limit": node_limit, "time_limit": time_limit_s,
                            "mip_rel_gap": 0.0, "presolve": True})
        if "time limit" in str(res.message).lower():
            return MilpResult(None, False, None, str(res.message), retry, timed_out=True)
        if res.x is None:
            return MilpResult(None, res.status == 2, None, str(res.message), retry)
        sch = _schedule(v, np.asarray(res.x), c.n, depth)
        peak = S.simulate(c, sch)[0]
        if budget_bytes is None or peak <= budget_bytes:
            gap = None if res.mip_gap is None else float(res.mip_gap)
            return MilpResult(sch, res.status == 0, gap, str(res.message), retry)
        target = (target or budget_bytes) - (peak - budget_bytes) - _unit(c)
    return MilpResult(None, False, None, "solver tolerance: no schedule within budget", 4)


def plan_ilp(graph: ChainLike, budget_bytes: int | None = None, time_limit_s: float = SAFETY_S,
             max_depth: int = 2, cuts: str = "auto", max_stages: int = 100,
             drop_cheap: bool = True, stage_time_s: list[float] | None = None,
             node_limit: int = NODE_LIMIT) -> Plan:
    """Least recomputation (FLOPs, or measured time with ``stage_time_s``, one per stage of
    ``ilp_chain(graph, cuts, max_stages)``) under the budget, by MILP; without a budget, the
    least peak, then the least recomputation at it. The 'optimal' dynamic program is exact on
    the same chain (every nesting depth): the MILP can only match it, so it runs on chains of
    at most ``max_stages`` stages (as a check; the DP's plan wins ties) and ``plan.notes`` say
    which plan is returned and why. Deterministic: HiGHS stops at ``node_limit`` nodes;
    ``time_limit_s`` is a safety net whose stop is reported and never used."""
    max_depth = int_param("max_depth", max_depth, 0, "Use e.g. max_depth=2.")
    max_stages = int_param("max_stages", max_stages, 2, "Use e.g. max_stages=100.")
    node_limit = int_param("node_limit", node_limit, 1, f"Use e.g. node_limit={NODE_LIMIT}.")
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not (
            time_limit_s > 0):
        raise bad_arg("time_limit_s", "seconds > 0", time_limit_s, "Use e.g. time_limit_s=600.")
    chain = ilp_chain(graph, cuts, max_stages)
    if stage_time_s is not None and len(stage_time_s) != chain.n:
        raise bad_arg("stage_time_s", f"{chain.n} forward times (one per stage of the ILP's "
                      "chain, see planners.ilp.ilp_chain)", len(stage_time_s),
                      "Measure each stage of that chain (memplan.timing.stage_times).")
    cost = None if stage_time_s is None else np.asarray(stage_time_s, dtype=np.float64)
    params = {"max_depth": max_depth, "cuts": cuts, "max_stages": max_stages,
              "drop_cheap": drop_cheap, "node_limit": node_limit,
              "objective": "flops" if cost is None else "time"}
    notes = [f"chain of {chain.n} stages through {'all' if cuts != 'clean' else 'clean'} cut "
             "points" if not isinstance(graph, C.Chain) else f"chain of {chain.n} stages"]

    def wrap(sch: tuple[S.Item, ...], budget: int | None, extra: str) -> Plan:
        return make_plan(chain, sch, "ilp", params, budget, tuple(notes + [extra]), stage_time_s)

    try:  # the dynamic program's plan: exact on this chain, the one to beat
        dp: Plan | None = plan_optimal(chain, budget_bytes, drop_cheap=drop_cheap,
                                       stage_time_s=stage_time_s)
    except BudgetTooSmall:
        dp = None
    if chain.n > max_stages:
        if dp is None:
            raise budget_too_small(budget_bytes or 0, plan_optimal(
                chain, None, drop_cheap=drop_cheap, stage_time_s=stage_time_s).peak_bytes, "ilp")
        return wrap(dp.schedule, budget_bytes, (
            f"{chain.n} stages, over max_stages={max_stages}: a MILP over merged groups cannot "
            f"beat the 'optimal' dynamic program, exact on all {chain.n} stages at every "
            "nesting depth; its plan is returned"))
    res = _milp_plan(chain, budget_bytes, max_depth, node_limit, drop_cheap, cost,
                     time_limit_s)
    status = (f"MILP (HiGHS, regions nested <= {max_depth} deep): "
              + ("not used: stopped by the time_limit_s safety net before its node limit"
                 if res.timed_out else "proven optimal" if res.proven else
                 f"node limit {node_limit} reached, gap "
                 f"{'unknown' if res.gap is None else f'{res.gap:.2%}'}"))
    mine = None if res.schedule is None else wrap(res.schedule, budget_bytes, status)
    clean = _clean_dp(graph, chain, budget_bytes, drop_cheap, stage_time_s)
    if clean is not None and all(_key(clean, budget_bytes) < _key(p, budget_bytes)
                                 for p in (mine, dp) if p is not None):
        note = (f"{status}; the 'optimal' dynamic program's plan on the clean chain "
                f"({len(clean.stages)} stages) is better and returned")
        return dataclasses.replace(clean, planner="ilp", params=params, notes=(*notes, note))
    if dp is not None and (mine is None or _key(dp, budget_bytes) <= _key(mine, budget_bytes)):
        why = "no better" if mine is not None else "no plan"
        return wrap(dp.schedule, budget_bytes, f"{status}; it found {why} than the 'optimal' "
                    "dynamic program (exact on this chain), whose plan is returned")
    if mine is None:  # nothing found at the budget: the least peak says why
        if budget_bytes is None:
            raise budget_too_small(0, 0, "ilp")  # unreachable: keep-all always fits no budget
        least = plan_ilp(chain, None, time_limit_s, max_depth, cuts, max_stages, drop_cheap,
                         stage_time_s, node_limit)
        if least.peak_bytes > budget_bytes:
            raise budget_too_small(budget_bytes, least.peak_bytes, "ilp")
        return wrap(least.schedule, budget_bytes,
                    f"{status} at the budget; the least-peak plan is returned")
    if budget_bytes is not None and mine.peak_bytes > budget_bytes:  # never: checked above
        raise budget_too_small(budget_bytes, mine.peak_bytes, "ilp")
    return mine


def _milp_plan(chain: C.Chain, budget_bytes: int | None, max_depth: int, node_limit: int,
               drop_cheap: bool, cost: np.ndarray | None, time_limit_s: float) -> MilpResult:
    """The MILP at the budget; without one, the least peak, then the least cost at it."""
    res = solve_milp(chain, budget_bytes, max_depth, node_limit, drop_cheap, cost, time_limit_s)
    if budget_bytes is None and res.schedule is not None:
        least_peak = S.simulate(chain, res.schedule)[0]
        again = solve_milp(chain, least_peak, max_depth, node_limit, drop_cheap, cost,
                           time_limit_s)
        res = again if again.schedule is not None else res
    return res


def _clean_dp(graph: ChainLike, chain: C.Chain, budget_bytes: int | None, drop_cheap: bool,
              stage_time_s: list[float] | None) -> Plan | None:
    """The dynamic program's plan on the graph's clean chain, when the ILP plans over another
    chain of the graph (with fine cut points the clean chain can beat the skips' over-count)."""
    if not isinstance(graph, g.Graph) or stage_time_s is not None:
        return None
    clean = C.build_chain(graph)
    if np.array_equal(clean.last, chain.last):
        return None
    try:
        return plan_optimal(clean, budget_bytes, drop_cheap=drop_cheap)
    except BudgetTooSmall:
        return None


def _key(p: Plan, budget_bytes: int | None) -> tuple[float, float]:
    """What the plan is judged by: cost (time when measured), then peak; or the reverse."""
    cost = float(p.extra_flops if p.predicted_time_s is None else p.predicted_time_s)
    return (cost, p.peak_bytes) if budget_bytes is not None else (p.peak_bytes, cost)
