"""The optimal planner's dynamic program over Pareto frontiers, compiled (numba).

C(s, t, m, dr) (``planners.optimal``) is, for each subproblem, a step function of the free
bytes m: least cost where m >= need. It is held exactly as its frontier: points (need, cost,
choice) by increasing need and strictly decreasing cost, so memory is exact to the byte and
nothing is rounded. A choice is KEEP, DROP_CHEAP or j >= 0: a region of stages s..s+j.

The recursion (Sec. 4.4; ``chain._run`` is the model):
  keep s:       shift C(s+1, t, ., 1) by xbar_s - dr*d_{s-1}, from its need, cost + f_s
  drop-cheap s: shift C(s+1, t, ., 1) by xsac_s, from its need, cost + f_s + fcheap_s (t = K-1)
  region s..e:  m -> f(s..e) + C(s, e, m, 0) + C(e+1, t, m - x_e, 1), from its forward's need
and C is the lower envelope of the choices. Sub-chains inside regions are solved once per
class of identical ones (``planners.repeats``), their needs stored relative to gb[t].

Two caps keep frontiers small without changing the optimum: needs above what can ever be free
(``mcap``), and costs above what an optimal plan can pay (``planners.bounds``: a point whose
cost alone makes the whole step dearer than the bound cannot be part of it).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memplan.core.jit import jit

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]

NEG = -(1 << 61)  # the need of the empty sequence
BIG = 1 << 62
KEEP, DROP_CHEAP = -1, -2
# Rows of the stage table (``program.stage_table``), one column per stage.
(COST, CHEAP, X, XBAR, DPREV, XSAC, TF_TOP, TF_IN, NEED_B, DC_NEED, TF0_TOP, TF0_IN, GF_IN,
 GB, EXIT_TOP) = range(15)
ROWS = 15


@jit
def find(pool: I64, off: int, n: int, m: int) -> int:
    """Index (from off) of the frontier point with the largest need <= m; -1 if none."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if pool[off + mid, 0] <= m:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@jit
def _affordable(pool: I64, off: int, n: int, limit: int) -> int:
    """Index (from off) of the first point costing <= limit (costs fall along a frontier)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if pool[off + mid, 1] <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo


@jit
def _room(buf: I64, n: int) -> I64:
    """``buf`` (capacity x 3: need, cost, choice), grown to hold n points."""
    if buf.shape[0] >= n:
        return buf
    out = np.empty((max(n, 2 * buf.shape[0]), 3), np.int64)
    out[: buf.shape[0]] = buf
    return out


@jit
def _put(out: I64, w: int, need: int, cost: int, choice: int) -> None:
    out[w, 0], out[w, 1], out[w, 2] = need, cost, choice


@jit
def _shifted(pool: I64, off: int, n: int, shift: int, need: int, add: int, cap: int,
             cost_cap: int, choice: int, out: I64) -> int:
    """Points (max(need_i + shift, need), cost_i + add): one choice followed by a frontier.
    Points collapsing onto ``need`` keep the cheapest; needs above cap and costs above
    cost_cap are dropped. Returns the count written to out."""
    w = 0
    for i in range(_affordable(pool, off, n, cost_cap - add), n):
        nd = max(pool[off + i, 0] + shift, need)
        if nd > cap:
            break
        if w > 0 and out[w - 1, 0] == nd:
            w -= 1
        _put(out, w, nd, pool[off + i, 1] + add, choice)
        w += 1
    return w


@jit
def _with_region(pool: I64, ao: int, an: int, ash: int, bo: int, bn: int, bsh: int,
                 need: int, add: int, cap: int, cost_cap: int, choice: int, env: I64, ne: int,
                 out: I64) -> int:
    """The least of env and the choice m -> A(m - ash) + B(m - bsh) + add for m >= need (a
    region's body, then what follows it), written to out (ties: env); -1: env unchanged.
    The choice starts where each of A and B alone, at the other's cheapest, first fits
    cost_cap; env is copied in bulk up to where the choice first beats it and from where it
    falls below all the choice can reach."""
    floor = pool[ao + an - 1, 1] + pool[bo + bn - 1, 1] + add  # the choice never costs less
    i = _affordable(pool, ao, an, cost_cap - add - pool[bo + bn - 1, 1])
    j = _affordable(pool, bo, bn, cost_cap - add - pool[ao + an - 1, 1])
    if i == an or j == bn:
        return -1
    cx = max(need, pool[ao + i, 0] + ash, pool[bo + j, 0] + bsh)
    if cx > cap or _dominated(env, ne, cx, floor):
        return -1
    k = find(env, 0, ne, cx - 1) + 1  # env's points before the choice starts
    w, ve, ce, vc = -1, (env[k - 1, 1] if k else BIG), (env[k - 1, 2] if k else 0), BIG
    while k < ne or cx <= cap:
        ex = env[k, 0] if k < ne else BIG
        nx = min(ex, cx)
        before = k  # env's points before nx
        if ex == nx:
            ve, ce = env[k, 1], env[k, 2]
            k += 1
        if cx == nx:
            while i + 1 < an and pool[ao + i + 1, 0] + ash <= nx:
                i += 1
            while j + 1 < bn and pool[bo + j + 1, 0] + bsh <= nx:
                j += 1
            vc = pool[ao + i, 1] + pool[bo + j, 1] + add
            vc = vc if vc <= cost_cap else BIG
            cx = min(pool[ao + i + 1, 0] + ash if i + 1 < an else BIG,
                     pool[bo + j + 1, 0] + bsh if j + 1 < bn else BIG)
            cx = cx if cx <= cap else BIG
        if w < 0 and vc < ve:  # the choice first beats env: env's points so far stand
            out[:before] = env[:before]
            w = before
        if w >= 0:
            v, c = (ve, ce) if ve <= vc else (vc, choice)
            if w == 0 or v < out[w - 1, 1]:
                _put(out, w, nx, v, c)
                w += 1
        if ve <= (vc if cx == BIG else floor):  # the rest of env is below the choice
            if w < 0:
                return -1
            out[w : w + ne - k] = env[k:ne]
            return w + ne - k
    return w


@jit
def _envelope(a: I64, na: int, b: I64, nb: int, out: I64) -> int:
    """Pointwise least of two frontiers (ties: a's choice)."""
    i, j, w = 0, 0, 0
    va, vb, ca, cb = BIG, BIG, 0, 0
    while i < na or j < nb:
        nx = min(a[i, 0] if i < na else BIG, b[j, 0] if j < nb else BIG)
        if i < na and a[i, 0] == nx:
            va, ca = a[i, 1], a[i, 2]
            i += 1
        if j < nb and b[j, 0] == nx:
            vb, cb = b[j, 1], b[j, 2]
            j += 1
        v, c = (va, ca) if va <= vb else (vb, cb)
        if w == 0 or v < out[w - 1, 1]:
            _put(out, w, nx, v, c)
            w += 1
    return w


@jit
def _dominated(env: I64, ne: int, need: int, cheapest: int) -> bool:
    """Whether a candidate starting at ``need`` and never below ``cheapest`` can improve on
    env nowhere (env falls with m, so its value at need bounds it above from there on)."""
    i = find(env, 0, ne, need)
    return i >= 0 and env[i, 1] <= cheapest


@jit
def ref(cid: I32, gb: I64, n_cls: int, s: int, t: int) -> tuple[int, int]:
    """(row of the frontier table, shift of its needs) for stages s..t: an inner class (needs
    relative to gb[t]), the top-level suffix s.. (row n_cls + s), or the empty sequence."""
    k = gb.shape[0]
    if s > t:
        return n_cls + k, 0
    if t == k - 1:
        return n_cls + s, 0
    return int(cid[s, t - s]), int(gb[t])


@jit
def _regions(st: I64, cid: I32, n_cls: int, tab: I64, pool: I64, s: int, t: int, last: int,
             g: int, cap: int, cost_cap: int, env: I64, ne: int, tmp: I64
             ) -> tuple[int, I64, I64]:
    """env (ne points) joined by the choices 'region s..e, then e+1..t' for e <= last (the
    last e whose body fits at all); returns the size and the buffers."""
    k = st.shape[1]
    top = t == k - 1
    tf0 = TF0_TOP if top else TF0_IN
    fwd, fsum = NEG, 0
    whole = 0
    for q in range(s, t + 1):
        whole += st[COST, q]
    for e in range(s, min(t, last + 1)):
        # The region's first forward keeps nothing but the inputs of its later stages.
        fwd = max(fwd, st[tf0, e] + (st[X, e - 1] if e > s else 0))
        fsum += st[COST, e]
        if g + fwd > cap:
            break  # monotone in e
        if whole + fsum > cost_cap:
            break  # every stage runs once, the body's twice: monotone in e too
        need = g + (max(fwd, st[EXIT_TOP, e]) if top else fwd)
        if need > cap:
            continue
        brow, bsh = ref(cid, st[GB], n_cls, s, e)
        rrow, rsh = ref(cid, st[GB], n_cls, e + 1, t)
        ao, an, bo, bn = tab[brow, 0, 0], tab[brow, 0, 1], tab[rrow, 1, 0], tab[rrow, 1, 1]
        if an == 0 or bn == 0:
            continue
        tmp = _room(tmp, ne + an + bn)
        w = _with_region(pool, ao, an, bsh, bo, bn, rsh + st[X, e], need, fsum, cap,
                         cost_cap, e - s, env, ne, tmp)
        if w >= 0:
            ne, env, tmp = w, tmp, env
    return ne, env, tmp


@jit
def _single(st: I64, pool: I64, ro: int, rn: int, rsh: int, s: int, dr: int, top: bool,
            g: int, cap: int, cost_cap: int, allow_dc: bool, out: I64, tmp: I64, mix: I64
            ) -> tuple[int, I64, I64, I64]:
    """'keep s' (and at the top level the better of it and 'drop-cheap s'), then the frontier
    of s+1..t at ro: (count, out, and the scratch buffers)."""
    credit = st[DPREV, s] * dr
    need = max(g + st[TF_TOP if top else TF_IN, s], st[NEED_B, s] - credit)
    out, tmp, mix = _room(out, rn), _room(tmp, rn), _room(mix, 2 * rn)
    n = _shifted(pool, ro, rn, rsh + st[XBAR, s] - credit, need, st[COST, s], cap, cost_cap,
                 KEEP, out)
    if top and allow_dc:
        nd = _shifted(pool, ro, rn, rsh + st[XSAC, s], st[DC_NEED, s],
                      st[COST, s] + st[CHEAP, s], cap, cost_cap, DROP_CHEAP, tmp)
        n = _envelope(out, n, tmp, nd, mix)
        out, mix = mix, out
    return n, out, tmp, mix


@jit
def _store(pool: I64, used: int, buf: I64, n: int, base: int) -> tuple[I64, int]:
    """Append a frontier (needs made relative to base); returns the pool and its new end."""
    pool = _room(pool, used + n)
    pool[used : used + n] = buf[:n]
    pool[used : used + n, 0] -= base
    return pool, used + n


@jit
def _within(buf: I64, n: int, base: int, caps: I64, off: int, cnt: int) -> int:
    """Keeps the points of buf (needs absolute; base: the row's) costing at most the cap at
    their need (caps[off : off + cnt]: a step function by need, relative); below its least
    need no plan fits. Returns the count kept."""
    w, j = 0, -1
    for i in range(n):
        while j + 1 < cnt and caps[off + j + 1, 0] <= buf[i, 0] - base:
            j += 1
        if j < 0 or buf[i, 1] > caps[off + j, 1]:
            continue
        buf[w] = buf[i]
        w += 1
    return w


@jit
def _most(caps: I64, ctab: I64, row: int) -> int:
    """The highest cap of a row (BIG: none given); caps fall with need."""
    most = -1
    for dr in range(2):
        if ctab[row, dr, 1] > 0:
            most = max(most, caps[ctab[row, dr, 0], 1])
    return BIG if ctab[row, 0, 1] == 0 and ctab[row, 1, 1] == 0 else most


@jit
def fill(st: I64, cid: I32, cls_cap: I64, mcap: int, top_cost_cap: I64, inner_slack: int,
         allow_dc: bool, caps: I64, ctab: I64) -> tuple[I64, I64]:
    """Every subproblem's frontier, shortest sub-chains first. Returns (pool, tab): pool holds
    the points (n x 3: need, cost, choice), tab[row, dr] = (offset, count) (rows: ``ref``).

    cls_cap[c]: a class's largest useful need (relative); mcap: the top level's. Costs kept:
    <= top_cost_cap[s] for the suffix from s, <= cost(s..t) + inner_slack inside regions, and
    <= the caps by need of the row where ctab gives some (``priced.Relaxation.caps``; ctab with
    no rows: none)."""
    k = st.shape[1]
    n_cls = cls_cap.shape[0]
    fpre = np.zeros(k + 1, np.int64)
    for q in range(k):
        fpre[q + 1] = fpre[q] + st[COST, q]
    tab = np.full((n_cls + k + 1, 2, 2), -1, np.int64)
    pool = np.empty((1 << 16, 3), np.int64)
    _put(pool, 0, NEG, 0, KEEP)  # the empty sequence: row n_cls + k
    for dr in range(2):
        tab[n_cls + k, dr, 0], tab[n_cls + k, dr, 1] = 0, 1
    used = 1
    last = np.arange(k) - 1  # last[s]: the last e whose body s..e fits (so far)
    env, cand = np.empty((1024, 3), np.int64), np.empty((1024, 3), np.int64)
    tmp, mix = np.empty((1024, 3), np.int64), np.empty((1024, 3), np.int64)
    for n in range(1, k + 1):
        for s in range(k - n + 1):
            t = s + n - 1
            row, base = ref(cid, st[GB], n_cls, s, t)
            if tab[row, 0, 0] >= 0:
                continue  # an identical sub-chain is solved
            top = t == k - 1
            cap = mcap if top else cls_cap[row] + base
            cost_cap = top_cost_cap[s] if top else fpre[t + 1] - fpre[s] + inner_slack
            by_need = row < ctab.shape[0] and (ctab[row, 0, 1] > 0 or ctab[row, 1, 1] > 0)
            if by_need:
                cost_cap = min(cost_cap, _most(caps, ctab, row))
            g = 0 if top else st[GF_IN, t]  # gradient bytes held while a region replays
            rrow, rsh = ref(cid, st[GB], n_cls, s + 1, t)
            ro, rn = tab[rrow, 1, 0], tab[rrow, 1, 1]
            if top:  # only dr = 1 is asked for (and dr = 0 at s = 0, the same: d_{-1} = 0)
                nk, env, tmp, mix = _single(st, pool, ro, rn, rsh, s, 1, True, g, cap,
                                            cost_cap, allow_dc, env, tmp, mix)
                nk, env, tmp = _regions(st, cid, n_cls, tab, pool, s, t, last[s], g, cap,
                                        cost_cap, env, nk, tmp)
                if by_need:
                    nk = _within(env, nk, 0, caps, ctab[row, 1, 0], ctab[row, 1, 1])
                tab[row, 1, 0] = used
                pool, used = _store(pool, used, env, nk, 0)
                tab[row, 1, 1] = nk
                tab[row, 0, 0], tab[row, 0, 1] = (used - nk, nk) if s == 0 else (0, 0)
                continue
            ne, env, tmp = _regions(st, cid, n_cls, tab, pool, s, t, last[s], g, cap, cost_cap,
                                    env, 0, tmp)
            for dr in range(2):
                if dr == 1 and st[DPREV, s] == 0:  # as dr = 0
                    tab[row, 1, 0], tab[row, 1, 1] = tab[row, 0, 0], tab[row, 0, 1]
                    continue
                nk, cand, tmp, mix = _single(st, pool, ro, rn, rsh, s, dr, False, g, cap,
                                             cost_cap, allow_dc, cand, tmp, mix)
                mix = _room(mix, nk + ne)
                w = _envelope(cand, nk, env, ne, mix)
                if by_need:
                    w = _within(mix, w, base, caps, ctab[row, dr, 0], ctab[row, dr, 1])
                tab[row, dr, 0], tab[row, dr, 1] = used, w
                pool, used = _store(pool, used, mix, w, base)
        for s in range(k - n):  # bodies of n stages are known now
            row, _ = ref(cid, st[GB], n_cls, s, s + n - 1)
            if tab[row, 0, 1] > 0:
                last[s] = s + n - 1
    return pool[:used], tab


@jit
def least_need(st: I64, cid: I32, n_cls: int, allow_dc: bool) -> int:
    """The fewest free bytes any schedule needs: the recursion of ``fill`` on needs alone (a
    number per subproblem instead of a frontier); BIG when nothing fits."""
    k = st.shape[1]
    need = np.full((n_cls + k + 1, 2), BIG, np.int64)
    need[n_cls + k] = NEG
    done = np.zeros(n_cls + k + 1, np.bool_)
    for n in range(1, k + 1):
        for s in range(k - n + 1):
            t = s + n - 1
            row, base = ref(cid, st[GB], n_cls, s, t)
            if done[row]:
                continue
            done[row] = True
            top = t == k - 1
            g = 0 if top else st[GF_IN, t]
            tf0 = TF0_TOP if top else TF0_IN
            best, fwd = BIG, NEG
            for e in range(s, t):
                fwd = max(fwd, st[tf0, e] + (st[X, e - 1] if e > s else 0))
                brow, bsh = ref(cid, st[GB], n_cls, s, e)
                rrow, rsh = ref(cid, st[GB], n_cls, e + 1, t)
                nf = max(fwd, st[EXIT_TOP, e]) if top else fwd
                best = min(best, max(g + nf, need[brow, 0] + bsh,
                                     need[rrow, 1] + rsh + st[X, e]))
            rrow, rsh = ref(cid, st[GB], n_cls, s + 1, t)
            rest = need[rrow, 1] + rsh
            for dr in range(2):
                credit = st[DPREV, s] * dr
                v = max(g + st[TF_TOP if top else TF_IN, s], st[NEED_B, s] - credit,
                        rest + st[XBAR, s] - credit)
                if top and allow_dc:
                    v = min(v, max(st[DC_NEED, s], rest + st[XSAC, s]))
                v = min(v, best)
                need[row, dr] = BIG if v >= BIG // 2 else v - base
    return int(need[n_cls, 0]) if need[n_cls, 0] < BIG // 2 else BIG
