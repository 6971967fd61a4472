"""Caps by free bytes for every subproblem of the optimal planner's program, from a relaxation
priced by ``body_bounds``: the proof of optimality at tight budgets (``search``).

A plan's cost is its top level's (keeps, drop-cheaps, each region's first forward) plus each
top-level body's. With every body priced by its bound instead, a plan's top level is a path
through the stages holding more bytes at each step; a forward program over (stage, bytes held,
in ``BUCKETS`` buckets) gives, for every prefix of the chain, the least priced cost at each
bucket: ``LP``. A bucket's state keeps, beside its least cost, the least bytes any prefix in
it holds, exactly, and steps add exact bytes to those: the merged state is at least as good
as each prefix merged into it (no more cost, no more bytes), a bound only falls with more free
bytes, so LP bounds every real prefix from below, and LP's least over the whole chain (R)
bounds the optimum. Its cost and bytes may come from different prefixes, so the bound weakens
where a bucket is large against a stage's bytes (LSTM T=2048 at 10 GB: buckets of 9.6 MB, a
step holds 7.6 MB; R is the forward pass alone); ``search`` prices only a probe's plan far
above the bound, which tight budgets make. There, rounding each step's bytes down to its
bucket, as before, lost more (T=2048 at 0.6 GB: R 2.238 forward passes, now 2.372, against
the optimum 2.394).

Caps for a plan costing at most ``upper`` (Sec. 4 of the proof, ``search``):
- a body, at any depth, at m bytes costs at most its bound at m plus upper - R: its excess
  over its bound is part of the plan's excess over R (a nested body's, of its parent's);
- the top-level suffix from s, at m bytes, costs at most upper - LP[s, b], b the bucket of
  the bytes its prefix holds (the free bytes less m): the prefix costs at least that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memplan.core.jit import jit
from memplan.core.planners.frontier import (
    BIG,
    CHEAP,
    COST,
    DC_NEED,
    DPREV,
    EXIT_TOP,
    GB,
    KEEP,
    NEED_B,
    TF0_TOP,
    TF_TOP,
    XBAR,
    XSAC,
    X,
)

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
BUCKETS = 1024  # held bytes in this many buckets of the free bytes (LSTM T=1024: as at 4096)


@jit
def _step(lp: I64, held: I64, s: int, b: int, to: int, unit: int, add_bytes: int,
          cost: int) -> None:
    """From the state (s, b), relax the state of stage ``to`` holding add_bytes more with cost.
    The last bucket holds all beyond (a suffix may still fit: the last stage's, or needs below
    zero); bytes held never fall below zero (counted from -credit, the least any prefix
    holds)."""
    now = max(held[s, b] + add_bytes, 0)
    b2 = min(now // unit, lp.shape[1] - 1)
    lp[to, b2] = min(lp[to, b2], cost)
    held[to, b2] = min(held[to, b2], now)


@jit
def prefix_costs(st: I64, cid: I32, bpool: I64, btab: I64, free: int, credit: int, unit: int,
                 upper: int, allow_dc: bool) -> I64:
    """LP[s, b]: a lower bound on the cost of any top level's stages 0..s-1 (bodies priced
    by their bounds) that leaves them holding bytes in bucket b (of ``unit`` bytes, counted
    from -credit: credits can free that much), among plans costing at most ``upper``."""
    k = st.shape[1]
    top_m = free + credit
    lp = np.full((k + 1, top_m // unit + 1), BIG, np.int64)
    held = np.full((k + 1, top_m // unit + 1), BIG, np.int64)  # bytes, within the bucket
    lp[0, credit // unit], held[0, credit // unit] = 0, credit
    rest = np.zeros(k + 1, np.int64)  # every stage from s runs once
    for q in range(k - 1, -1, -1):
        rest[q] = rest[q + 1] + st[COST, q]
    live = np.empty(lp.shape[1], np.int64)
    for s in range(k):
        n, best = 0, BIG
        for b in range(lp.shape[1]):  # a state holding more and costing no less: dominated
            if lp[s, b] < best and lp[s, b] + rest[s] <= upper:
                best = lp[s, b]
                live[n] = b
                n += 1
        for q in range(n):  # keep s or drop-cheap s (``frontier._single`` at the top level)
            b = live[q]
            m = top_m - held[s, b]  # at least the free bytes of any prefix in the state
            if max(st[TF_TOP, s], st[NEED_B, s] - st[DPREV, s]) <= m:
                _step(lp, held, s, b, s + 1, unit, st[XBAR, s] - st[DPREV, s],
                      lp[s, b] + st[COST, s])
            if allow_dc and st[DC_NEED, s] <= m:
                _step(lp, held, s, b, s + 1, unit, st[XSAC, s],
                      lp[s, b] + st[COST, s] + st[CHEAP, s])
        if n:
            _regions(st, cid, bpool, btab, lp, held, s, live, n, top_m, unit, upper, rest)
    return lp


@jit
def _regions(st: I64, cid: I32, bpool: I64, btab: I64, lp: I64, held: I64, s: int,
             live: I64, n: int, top_m: int, unit: int, upper: int, rest: I64) -> None:
    """The choices 'region s..e' from the live states of s (``frontier._regions``), the body
    priced by its bound at the state's free bytes (states by falling free bytes, as their
    buckets rise: the bound's point walks down its frontier; their costs fall)."""
    k = st.shape[1]
    fwd, fsum, first = -(1 << 61), 0, 0
    cheapest = lp[s, live[n - 1]]
    for e in range(s, k - 1):  # the last stage is never in a region
        fwd = max(fwd, st[TF0_TOP, e] + (st[X, e - 1] if e > s else 0))
        fsum += st[COST, e]
        # The region runs twice: states too dear for it now are for every longer one.
        while first < n and lp[s, live[first]] + rest[s] + fsum > upper:
            first += 1
        if first == n:
            break
        row = cid[s, e - s]
        off, cnt = btab[row, 0, 0], btab[row, 0, 1]
        i = cnt - 1
        need = max(fwd, st[EXIT_TOP, e])
        for q in range(first, n):
            b = live[q]
            m = top_m - held[s, b]
            if need > m:
                break
            while i >= 0 and bpool[off + i, 0] > m - st[GB, e]:
                i -= 1
            if i < 0:
                break  # the body fits nowhere below
            if cheapest + fsum + bpool[off + i, 1] + rest[e + 1] > upper:
                break  # later states: less free (a dearer body), at most this much cheaper
            cost = lp[s, b] + fsum + bpool[off + i, 1]
            if cost + rest[e + 1] <= upper:
                _step(lp, held, s, b, e + 1, unit, st[X, e], cost)


@jit
def top_caps(lp: I64, free: int, credit: int, unit: int, upper: int) -> tuple[I64, I64]:
    """The suffix rows' caps as frontiers (need, cap, KEEP), one per stage s: at m free bytes
    the suffix from s may cost upper - min(LP[s, b'] for b' <= b), b the bucket of the bytes
    its prefix holds; where no prefix holds so little, nothing (cap -1)."""
    k = lp.shape[0] - 1
    nb = lp.shape[1]
    top_m = free + credit
    pool = np.empty((k * (nb + 1), 3), np.int64)
    tab = np.zeros((k, 2), np.int64)
    used = 0
    for s in range(k):
        tab[s, 0] = used
        least = np.empty(nb, np.int64)  # LP's least over buckets up to b
        run = BIG
        for b in range(nb):
            run = min(run, lp[s, b])
            least[b] = run
        for b in range(nb - 1, -1, -1):  # needs rise as the prefix's bytes fall
            if least[b] >= BIG:
                need = top_m - (b + 1) * unit + 1 if b < nb - 1 else -BIG
                pool[used, 0], pool[used, 1], pool[used, 2] = need, -1, KEEP
                used += 1
                break
            if b < nb - 1 and least[b] == least[b + 1]:
                continue  # the same cap: the point below stands for this bucket too
            pool[used, 0] = top_m - (b + 1) * unit + 1 if b < nb - 1 else -BIG
            pool[used, 1], pool[used, 2] = upper - least[b], KEEP
            used += 1
        tab[s, 1] = used - tab[s, 0]
    return pool[:used], tab


@dataclass(frozen=True)
class Relaxation:
    """The priced relaxation of one program at ``free`` bytes, among plans costing at most
    the ``upper`` it was made for (``relax``): caps for any cost up to that."""

    bodies: tuple[I64, I64]  # ``body_bounds.fill_bounds``
    lp: I64
    unit: int
    free: int
    credit: int

    @property
    def root(self) -> int:
        """R: a lower bound on the optimum (BIG: no plan within the upper cost)."""
        return int(self.lp[-1].min())

    def caps(self, upper: int) -> tuple[I64, I64]:
        """Caps by need for every row of ``frontier.fill`` that keep each plan costing at most
        ``upper`` (inner classes: the bound plus upper - R; suffixes: ``top_caps``), as
        frontiers, tab[row, dr] = (offset, count)."""
        bpool, btab = self.bodies
        k = self.lp.shape[0] - 1
        n_cls = btab.shape[0]
        tpool, ttab = top_caps(self.lp, self.free, self.credit, self.unit, upper)
        inner = bpool.copy()
        inner[:, 1] += upper - self.root
        tab = np.zeros((n_cls + k + 1, 2, 2), np.int64)
        tab[:n_cls] = btab
        tab[n_cls : n_cls + k, :, 0] = (ttab[:, 0] + len(inner))[:, None]
        tab[n_cls : n_cls + k, :, 1] = ttab[:, 1][:, None]
        return np.concatenate([inner, tpool]), tab


def relax(st: I64, cid: I32, bodies: tuple[I64, I64], free: int, credit: int, upper: int,
          allow_dc: bool) -> Relaxation:
    """The relaxation among plans costing at most ``upper`` (``prefix_costs``)."""
    unit = max(1, (free + credit) // BUCKETS)
    lp = prefix_costs(st, cid, bodies[0], bodies[1], free, credit, unit, upper, allow_dc)
    return Relaxation(bodies, lp, unit, free, credit)
