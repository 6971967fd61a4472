"""The ``ilp`` planner's program: the chain's least-recompute schedule as a MILP (columns,
rows, objective) and the schedule read back from a solution. Solved in ``planners.ilp``.

The program is exact for the chain model, in bytes (no memory slots), over schedules of keep /
drop-cheap stages and recompute regions nested at most ``depth`` deep (Sec. 4.4; the paper's
mirror count m(v) is the depth). Per stage k and level l = 1..L, binaries ``in[l,k]`` (k is
inside a level-l region), ``a[l,k]``/``z[l,k]`` (one starts/ends at k) and ``c[k]``
(drop-cheap); continuous ``W[l,k]``: bytes resident before k in its level-l sequence, and
``G[l,k]``: the gradient bytes of the end of its level-l region. They follow ``chain._run``
item by item:

  W[0,k+1] = W[0,k] + keep: xbar_k - d_{k-1} | drop-cheap: xsac_k | region end: x_k
  W[l,k]   = W[l-1,k] at a level-l start, else W[l,k-1] + the same for level l
  peak    >= W + tf_k (+ G), W + xbar_k - d_{k-1} + gb_k + tb_k, W + need_sac_b_k,
             and for a region's first forward W + (G) + tf0_k + x_{k-1} (inside a region,
             the replay transients tfr_k, tfr0_k; a drop-cheap forward, tfs_k)

the top level's as exact rows (a stage is kept, drop-cheap or in a region), the others as
big-M rows whose M is the row's own range (``Model.le_big``). The objective is the executed
forward cost: sum_k cost_k * depth_k + drop-cheap's recomputed ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.errors import bad_arg

Terms = list[tuple[int, float]]
Vars = dict[str, list[list[int]]]  # name -> level -> stage -> column


@dataclass
class Model:
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


def unit(c: C.Chain) -> int:
    """Bytes per model unit: a power of two bringing the largest byte count near 1e6."""
    top = float(c.base_bytes + np.abs(c.xbar).sum() + np.abs(c.xsac).sum() + np.abs(c.x).sum())
    return 1 << max(0, math.ceil(math.log2(max(top, 1.0) / 1e6)))


@dataclass(frozen=True)
class _Sizes:
    """The chain's per-stage bytes in model units (``unit``), as the rows use them."""

    x: np.ndarray
    xbar: np.ndarray
    xsac: np.ndarray
    dprev: np.ndarray  # d_{k-1}: the credit of a kept stage's input
    tf: np.ndarray
    tf0: np.ndarray
    gb: np.ndarray  # gradient bytes when a region ending there replays (chain._run)
    tfr: np.ndarray  # inside regions the runtime replays (chain.Chain.tf_replay, tf0_replay)
    tfr0: np.ndarray
    tfs: np.ndarray
    back_keep: np.ndarray
    back_cheap: np.ndarray
    base: float

    @classmethod
    def of(cls, c: C.Chain, u: int) -> _Sizes:
        if (c.tf0 < 0).any() or (c.x < 0).any():  # byte counts: the top-level rows rely on it
            raise bad_arg("chain", "tf0 and x >= 0 (bytes)", "negative values",
                          "Build the chain with memplan.chain.build_chain(graph).")
        dprev = np.concatenate(([0.0], c.d[:-1] / u))
        return cls(c.x / u, c.xbar / u, c.xsac / u, dprev, c.tf / u, c.tf0 / u,
                   (c.gb + c.d) / u, c.tf_replay / u, c.tf0_replay / u, c.tf_sac / u,
                   (c.xbar + c.gb + c.tb) / u - dprev, c.need_sac_b / u, c.base_bytes / u)


class _Builder:
    """The program's columns, then its rows stage by stage (the order HiGHS sees is part of
    the result: rows are added in one fixed order)."""

    def __init__(self, c: C.Chain, budget_bytes: int | None, depth: int,
                 drop_cheap: bool) -> None:
        k_n, u = c.n, unit(c)
        self.c, self.u, self.depth, self.drop_cheap = c, u, depth, drop_cheap
        s = self.s = _Sizes.of(c, u)
        w_hi = s.base + float(np.maximum.reduce([s.x, s.xbar, s.xsac, np.zeros(k_n)]).sum())
        w_lo = s.base - float(s.dprev.sum())
        m = self.m = Model()
        self.levels = range(1, depth + 1)
        v: Vars = {"c": [m.var(k_n, 0, 1.0 if drop_cheap else 0.0, True)]}
        for name, lb, ub, integer in (("in", 0, 1, True), ("a", 0, 1, True),
                                      ("z", 0, 1, True), ("ka", 0, 1, False),
                                      ("G", float(s.gb.min()), float(s.gb.max()), False)):
            v[name] = [[]] + [m.var(k_n, lb, ub, integer) for _ in self.levels]
        v["W"] = [m.var(k_n, w_lo, w_hi, False) for _ in range(depth + 1)]
        m.lb[v["W"][0][0]] = m.ub[v["W"][0][0]] = s.base
        for lv in self.levels:  # the last stage ends every sequence: never in a region
            for name in ("in", "a", "z"):
                m.ub[v[name][lv][k_n - 1]] = 0.0
        self.v = v
        self.peak_var = None if budget_bytes is not None else m.var(1, s.base, math.inf,
                                                                    False)[0]
        self.rhs = 0.0 if budget_bytes is None else budget_bytes / u
        self.peak: Terms = [] if self.peak_var is None else [(self.peak_var, -1.0)]

    def at(self, name: str, lv: int, k: int) -> list[int]:
        """The variable, or nothing for level depth + 1 (never a region)."""
        return [self.v[name][lv][k]] if 1 <= lv <= self.depth else []

    def rows(self) -> None:
        for k in range(self.c.n):
            self._structure(k)
            self._top_memory(k)
            self._level_memory(k)
            self._top_peaks(k)
            self._level_peaks(k)

    def _structure(self, k: int) -> None:
        """Regions are intervals, nested inside their level's regions; drop-cheap only at
        the top level; ``ka`` marks a kept stage right after a region starts."""
        m, v, at = self.m, self.v, self.at
        inn, a, zz, ka = v["in"], v["a"], v["z"], v["ka"]
        m.le_big([(v["c"][0][k], 1.0)] + [(i, 1.0) for i in at("in", 1, k)], 1.0)
        for lv in self.levels:
            m.row([(a[lv][k], 1.0), (inn[lv][k], -1.0)], -math.inf, 0.0)
            m.row([(zz[lv][k], 1.0), (inn[lv][k], -1.0)], -math.inf, 0.0)
            cont = [(inn[lv][k - 1], -1.0), (zz[lv][k - 1], 1.0)] if k else []
            m.row([(inn[lv][k], 1.0), (a[lv][k], -1.0)] + cont, 0.0, 0.0)
            if lv < self.depth:  # an inner region sits inside and never ends its sequence
                m.row([(inn[lv + 1][k], 1.0), (inn[lv][k], -1.0)], -math.inf, 0.0)
                m.row([(inn[lv + 1][k], 1.0), (zz[lv][k], 1.0)], -math.inf, 1.0)
                m.row([(a[lv][k], 1.0), (inn[lv + 1][k], 1.0), (a[lv + 1][k], -1.0)],
                      -math.inf, 1.0)
            keep = [(inn[lv][k], 1.0)] + [(i, -1.0) for i in at("in", lv + 1, k)]
            m.row(keep + [(a[lv][k], 1.0), (ka[lv][k], -1.0)], -math.inf, 1.0)

    def _top_memory(self, k: int) -> None:
        """W[0, k+1] from W[0, k]; and the next forward after a top-level region ends at k."""
        if k + 1 >= self.c.n:
            return
        m, s, w, at = self.m, self.s, self.v["W"], self.at
        step = float(s.xbar[k] - s.dprev[k])
        terms = [(w[0][k], 1.0), (w[0][k + 1], -1.0), (self.v["c"][0][k], float(s.xsac[k]) - step)]
        terms += [(i, -step) for i in at("in", 1, k)] + [(i, float(s.x[k])) for i in at("z", 1, k)]
        m.row(terms, -math.inf, -step)
        exit_k = S.region_exit(self.c, k) / self.u - float(s.x[k])  # beyond W[0, k+1] (x_k)
        if exit_k > 0 and self.depth:
            m.le_big([(w[0][k + 1], 1.0)] + self.peak, self.rhs - exit_k,
                     [(i, -1.0) for i in at("z", 1, k)], 1.0)

    def _level_memory(self, k: int) -> None:
        """W[l, k] inside level-l sequences, and G (the gradient of a region's end)."""
        m, s, v, at = self.m, self.s, self.v, self.at
        inn, a, zz, ka, gg, w = (v[n] for n in ("in", "a", "z", "ka", "G", "W"))
        for lv in self.levels:
            m.le_big([(w[lv - 1][k], 1.0), (w[lv][k], -1.0)], 0.0, [(a[lv][k], -1.0)], 1.0)
            if k:
                j, step = k - 1, float(s.xbar[k - 1] - s.dprev[k - 1])
                terms = [(w[lv][j], 1.0), (w[lv][k], -1.0), (inn[lv][j], step),
                         (ka[lv][j], float(s.dprev[j]))]
                terms += [(i, -step) for i in at("in", lv + 1, j)]
                terms += [(i, float(s.x[j])) for i in at("z", lv + 1, j)]
                m.le_big(terms, 0.0, [(inn[lv][k], -1.0), (a[lv][k], 1.0)], 1.0)
            m.le_big([(gg[lv][k], -1.0)], -float(s.gb[k]), [(zz[lv][k], -1.0)], 1.0)
            if k + 1 < self.c.n:
                m.le_big([(gg[lv][k + 1], 1.0), (gg[lv][k], -1.0)], 0.0,
                         [(inn[lv][k], -1.0), (zz[lv][k], 1.0)], 1.0)

    def _top_peaks(self, k: int) -> None:
        """Peaks at the top level, exact without a big M: a stage is kept, drop-cheap or in a
        region, and a region's first forward (W + tf0_k (+ x_{k-1}) <= peak) bounds W there."""
        m, s, cv, at = self.m, self.s, self.v["c"], self.at
        w0 = [(self.v["W"][0][k], 1.0)] + self.peak
        xin = float(s.x[k - 1]) if k else 0.0
        in1, a1 = at("in", 1, k), at("a", 1, k)
        fwd = [(i, float(s.tf0[k] + xin - s.tf[k])) for i in in1] + [(i, -xin) for i in a1]
        fwd += [(cv[0][k], float(s.tfs[k] - s.tf[k]))] if self.drop_cheap else []
        m.le_big(w0 + fwd, self.rhs - float(s.tf[k]))
        back = [(i, float(s.tf0[k] - s.back_keep[k])) for i in in1]
        back += [(cv[0][k], float(s.back_cheap[k] - s.back_keep[k]))] if self.drop_cheap else []
        m.le_big(w0 + back, self.rhs - float(s.back_keep[k]))

    def _level_peaks(self, k: int) -> None:
        """Peaks inside regions (big M: only where the stage is kept at that level), and a
        nested region's first forward, nothing saved."""
        m, s, v, at, rhs, peak = self.m, self.s, self.v, self.at, self.rhs, self.peak
        inn, a, ka, gg, w = (v[n] for n in ("in", "a", "ka", "G", "W"))
        for lv in self.levels:
            not_keep = [(inn[lv][k], -1.0)] + [(i, 1.0) for i in at("in", lv + 1, k)]
            m.le_big([(w[lv][k], 1.0), (gg[lv][k], 1.0)] + peak, rhs - float(s.tfr[k]),
                     not_keep, 1.0)
            m.le_big([(w[lv][k], 1.0), (ka[lv][k], float(s.dprev[k]))] + peak,
                     rhs - float(s.back_keep[k]), not_keep, 1.0)
        xin = float(s.x[k - 1]) if k else 0.0
        for lv in range(1, self.depth):
            terms = [(w[lv][k], 1.0)] + ([(gg[lv][k], 1.0)] if lv else []) + peak
            terms += [(a[lv + 1][k], -xin)] if xin else []
            m.le_big(terms, rhs - float(s.tfr0[k]) - xin, [(inn[lv + 1][k], -1.0)], 1.0)


def build(c: C.Chain, budget_bytes: int | None, depth: int, drop_cheap: bool
          ) -> tuple[Model, Vars, int | None]:
    """The program for ``c`` at ``budget_bytes`` (None: minimise the peak, whose column is
    returned), regions nested at most ``depth`` deep."""
    b = _Builder(c, budget_bytes, depth, drop_cheap)
    b.rows()
    return b.m, b.v, b.peak_var


def objective(c: C.Chain, m: Model, v: Vars, cost: np.ndarray, peak_var: int | None
              ) -> np.ndarray:
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


def schedule(v: Vars, sol: np.ndarray, k_n: int, depth: int) -> tuple[S.Item, ...]:
    """The schedule a solution encodes."""
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
