"""Lower bounds on a region body's cost as a function of its free bytes: the optimal planner's
proof of optimality at tight budgets (``search``).

Inside a body s..t (``frontier``: C(s, t, m, dr)) every stage runs forward once, and the
stages its own level does not keep run again. The stages it keeps hold bytes until their
backward, and the last stage t is always kept: so, as for the whole chain (``bounds``), what
the kept stages before t hold plus t's own need fits m, and the FLOPs kept form a knapsack.
Its bound is the least of the LP relaxation (by efficiency) and the most the largest n
profits give, n the count of the lightest items that fit. Both grow with m, so over a range
of m each is at most its value at the range's end: the bound is a frontier (need, cost).

Stages whose credit exceeds what they keep (xbar < d_{s-1}) free bytes when kept: t's need
is lowered by all they can free, and the knapsack's capacity counts from there.

Why: ``priced`` prices every body by its bound. A body's excess over its bound contains its
nested bodies' excesses, so caps of bound + slack at every depth keep each plan within that
slack of the priced optimum; most of a tight budget's frontier points lie beyond (a body's
cost is mostly what its size forces, which the bound sees).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memplan.core.jit import jit
from memplan.core.planners import frontier as F

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
STEPS = 64  # points at most per bound (ranges merged beyond: each still an upper end's value)


def item_kinds(st: I64) -> tuple[I64, I64, I64, I64, I64]:
    """Stages as knapsack items (weight xbar - d_{s-1}: kept after a kept stage; profit: its
    cost), grouped into kinds of equal items: (kind per stage, weight and profit per kind,
    kinds by efficiency, kinds by profit; both orders deterministic)."""
    w, p = st[F.XBAR] - st[F.DPREV], st[F.COST]
    pairs, kind = np.unique(np.stack([w, p], axis=1), axis=0, return_inverse=True)
    kw, kp = pairs[:, 0].copy(), pairs[:, 1].copy()
    eff = np.where(kw > 0, kp / np.maximum(kw, 1), np.inf)  # free items first
    by_eff = np.lexsort((np.arange(len(kw)), -eff)).astype(np.int64)
    by_profit = np.lexsort((np.arange(len(kw)), -kp)).astype(np.int64)
    return kind.ravel().astype(np.int64), kw, kp, by_eff, by_profit


@jit
def _lp_saving(cap: int, order: I64, w: I64, p: I64, n: I64) -> int:
    """The LP relaxation's most profit in capacity cap (items with w <= 0 free), rounded down
    (profits are integers); a float bound, raised by one for its rounding."""
    room, total = float(cap), 0.0
    for k in order:
        if n[k] == 0:
            continue
        if w[k] <= 0:
            total += float(n[k] * p[k])
            continue
        if room <= 0:
            break
        take = min(float(n[k]), room / w[k])
        total += take * p[k]
        room -= take * w[k]
    return int(np.floor(total)) + 1


@jit
def _top_profit(count: int, free_p: int, order: I64, w: I64, p: I64, n: I64) -> int:
    """The most profit of ``count`` items with w > 0 (the largest profits), plus the free."""
    total = free_p
    for k in order:
        if count <= 0:
            break
        if w[k] <= 0 or n[k] == 0:
            continue
        take = min(count, n[k])
        total += take * p[k]
        count -= take
    return total


@jit
def _row(st: I64, s: int, t: int, dr: int, cap: int, items: tuple[I64, I64, I64, I64, I64],
         cnt: I64, out: I64) -> int:
    """The bound's points for C(s, t, ., dr) (needs relative to gb[t], up to cap) into out."""
    _, kw, kp, by_eff, by_profit = items
    nk = kw.shape[0]
    credit = st[F.DPREV, t] * (1 if t > s else dr)
    need = max(st[F.GF_IN, t] + st[F.TF_IN, t], st[F.NEED_B, t] - credit) - st[F.GB, t]
    fsum = 0
    for q in range(s, t + 1):
        fsum += st[F.COST, q]
    if s == t:
        if need > cap:
            return 0
        out[0, 0], out[0, 1], out[0, 2] = need, fsum, F.KEEP
        return 1
    # Items s..t-1: kinds with counts; the entry s is its own item (its credit is dr's).
    w, p, n = np.empty(nk + 1, np.int64), np.empty(nk + 1, np.int64), np.zeros(nk + 1, np.int64)
    w[:nk], p[:nk] = kw, kp
    n[:nk] = cnt[t] - cnt[s + 1]
    w[nk], p[nk], n[nk] = st[F.XBAR, s] - st[F.DPREV, s] * dr, st[F.COST, s], 1
    eff = np.empty(nk + 1, np.int64)  # the entry placed by its efficiency
    prof = np.empty(nk + 1, np.int64)
    _insert(by_eff, nk, w, p, True, eff)
    _insert(by_profit, nk, w, p, False, prof)
    total, free_p, wmin, heavy, freed = 0, 0, F.BIG, 0, 0
    for k in range(nk + 1):
        total += n[k] * p[k]
        if n[k] > 0 and w[k] <= 0:
            free_p += n[k] * p[k]
            freed -= n[k] * w[k]
        elif n[k] > 0:
            wmin = min(wmin, w[k])
            heavy += n[k]
    # Stages that free more than they keep (a credit above xbar) leave t more room: the
    # least need is t's less all they free; capacities below count from there.
    need -= freed
    if need > cap:
        return 0
    if heavy == 0:
        out[0, 0], out[0, 1], out[0, 2] = need, fsum, F.KEEP
        return 1
    # Ranges [a, b) of capacity: n items of weight >= wmin fit only from n * wmin on.
    step = max(wmin, -(-(cap - need + 1) // STEPS))
    c = 0
    pts = 0
    best = F.BIG
    while need + c <= cap:
        end = c + step - 1
        count = end // wmin
        saving = min(_top_profit(count, free_p, prof, w, p, n),
                     _lp_saving(end, eff, w, p, n), total)
        cost = fsum + total - saving
        if cost < best:
            out[pts, 0], out[pts, 1], out[pts, 2] = need + c, cost, F.KEEP
            pts += 1
            best = cost
        if saving >= total:
            break
        c += step
    return pts


@jit
def _insert(order: I64, nk: int, w: I64, p: I64, by_efficiency: bool, out: I64) -> None:
    """``order`` (kinds 0..nk-1) with item nk placed where its key puts it (before equals)."""
    j = 0
    placed = False
    for k in order:
        if not placed and _before(nk, k, w, p, by_efficiency):
            out[j] = nk
            j += 1
            placed = True
        out[j] = k
        j += 1
    if not placed:
        out[j] = nk


@jit
def _before(a: int, b: int, w: I64, p: I64, by_efficiency: bool) -> bool:
    """Whether item a sorts before item b: more profit, or more profit per byte (free first)."""
    if not by_efficiency:
        return bool(p[a] >= p[b])
    if w[a] <= 0 or w[b] <= 0:
        return bool(w[a] <= 0)
    return bool(p[a] * w[b] >= p[b] * w[a])


@jit
def fill_bounds(st: I64, cid: I32, cls_cap: I64, items: tuple[I64, I64, I64, I64, I64]
                ) -> tuple[I64, I64]:
    """The bound of every inner class and dr, as ``frontier.fill``'s (pool, tab) for rows
    below n_cls (one per class, its first member; needs relative to its gb[t])."""
    k = st.shape[1]
    n_cls = cls_cap.shape[0]
    nk = items[1].shape[0]
    cnt = np.zeros((k + 1, nk), np.int64)
    for q in range(k):
        cnt[q + 1] = cnt[q]
        cnt[q + 1, items[0][q]] += 1
    tab = np.full((n_cls, 2, 2), -1, np.int64)
    pool = np.empty((1 << 16, 3), np.int64)
    out = np.empty((STEPS + 2, 3), np.int64)
    used = 0
    for n in range(1, k):
        for s in range(k - n):
            t = s + n - 1
            row, _ = F.ref(cid, st[F.GB], n_cls, s, t)
            if tab[row, 0, 0] >= 0:
                continue
            for dr in range(2):
                w = _row(st, s, t, dr, cls_cap[row], items, cnt, out)
                if used + w > pool.shape[0]:
                    grown = np.empty((2 * pool.shape[0] + w, 3), np.int64)
                    grown[:used] = pool[:used]
                    pool = grown
                pool[used : used + w] = out[:w]
                tab[row, dr, 0], tab[row, dr, 1] = used, w
                used += w
    return pool[:used], tab
