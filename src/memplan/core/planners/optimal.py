"""``optimal``: least recomputation under a peak budget, a rotor-style dynamic program
(Beaumont et al. 2019) over the chain model of ``memplan.chain``, with nested regions
(Sec. 4.4) and drop-cheap stages (Sec. 4.2) as choices. Exact under that model with
``slot_bytes=1``; otherwise memory is counted in slots, rounded against us (every plan it
returns fits). Chains longer than ``max_stages`` are first merged into balanced groups.

C(s, t, m, dr): least forward FLOPs executed to run stages s..t forward and backward with m
bytes free (input of s kept by the caller; dr: that input may be dropped once read):
  keep s:      f_s + C(s+1, t, m - xbar_s + dr*d_{s-1}, 1)
  drop-cheap:  f_s + fcheap_s + C(s+1, t, m - xsac_s, 1)        (top level only)
  region s..e: sum f_s..e + C(e+1, t, m - x_e, 1) + C(s, e, m, 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.core.budget import budget_too_small
from memplan.core.chain import I64, Chain
from memplan.core.plan import Plan, make_plan
from memplan.core.planners.common import ChainLike, as_chain, int_param
from memplan.core.schedule import DropCheap, Item, Keep, Region, plain_schedule, simulate
from memplan.errors import bad_arg

INF = np.inf


def coarsen(c: Chain, max_stages: int) -> tuple[Chain, list[tuple[int, int]]]:
    """Merge consecutive stages into at most ``max_stages`` groups of similar kept bytes."""
    k = c.n
    if k <= max_stages:
        return c, [(s, s) for s in range(k)]
    weight = np.cumsum(np.maximum(c.xbar, 1)).astype(np.float64)
    marks = np.searchsorted(weight, weight[-1] * np.arange(1, max_stages) / max_stages)
    ends = sorted({int(m) for m in marks if m < k - 1} | {k - 1})
    groups, lo = [], 0
    for e in ends:
        groups.append((lo, e))
        lo = e + 1
    return merge(c, groups), groups


def merge(c: Chain, groups: list[tuple[int, int]]) -> Chain:
    """The chain whose stages are the groups; each group behaves as its stages run plainly
    (keep), as one region (region forward), or as drop-cheap stages one by one."""
    dprev = np.concatenate(([0], c.d[:-1]))
    out: dict[str, list[int]] = {n: [] for n in ("f", "b", "x", "xbar", "d", "xsac", "xsac_b",
                                                 "fcheap", "tf", "tf0", "tb", "gb", "tfr",
                                                 "tfr0", "tfs")}
    for a, b in groups:
        own = c.xbar[a : b + 1] - np.concatenate(([0], dprev[a + 1 : b + 1]))
        res = np.concatenate(([0], np.cumsum(own)))
        xs = np.concatenate(([0], np.cumsum(c.xsac[a : b + 1])))
        tf = int(np.max(res[:-1] + c.tf[a : b + 1]))
        xin = np.concatenate(([0], c.x[a:b]))
        peak_b = int(np.max(res[1:] + c.gb[a : b + 1] + c.tb[a : b + 1]))
        peak_sac = int(np.max(xs[:-1] + c.need_sac_b[a : b + 1]))
        gb = int(c.gb[b])
        tb = peak_b - int(res[-1]) - gb
        vals = {
            "f": int(c.f[a : b + 1].sum()), "b": int(c.b[a : b + 1].sum()), "x": int(c.x[b]),
            "xbar": int(res[-1]), "d": int(c.d[b]), "xsac": int(xs[-1]),
            "xsac_b": peak_sac - gb - tb, "fcheap": int(c.fcheap[a : b + 1].sum()), "tf": tf,
            "tf0": int(np.max(c.tf0[a : b + 1] + xin)), "tb": tb, "gb": gb,
            "tfr": int(np.max(res[:-1] + c.tf_replay[a : b + 1])),
            "tfr0": int(np.max(c.tf0_replay[a : b + 1] + xin)),
            "tfs": int(np.max(xs[:-1] + c.tf_sac[a : b + 1])),
        }
        for name, v in vals.items():
            out[name].append(v)
    arr = {n: np.array(v, dtype=np.int64) for n, v in out.items()}
    return Chain(
        fingerprint=c.fingerprint, first=np.array([c.first[a] for a, _ in groups], dtype=np.int64),
        last=np.array([c.last[b] for _, b in groups], dtype=np.int64),
        modules=tuple(c.modules[b] for _, b in groups), base_bytes=c.base_bytes,
        step_flops=c.step_flops, f=arr["f"], b=arr["b"], x=arr["x"], xbar=arr["xbar"],
        d=arr["d"], xsac=arr["xsac"], xsac_b=arr["xsac_b"], fcheap=arr["fcheap"], tf=arr["tf"],
        tf0=arr["tf0"], tb=arr["tb"], gb=arr["gb"], tfr=arr["tfr"], tfr0=arr["tfr0"],
        tfs=arr["tfs"],
    )


def _slots(v: I64, slot: int) -> I64:
    return -(-v // slot)  # ceil, also for negatives


@dataclass
class _Tables:
    """The filled program, indexed [t, s, m] (end, start, free slots): t0 for dr=0, t1 for
    dr=1, r1 = t1 shifted by x_{s-1} (the checkpoint a region ending at s-1 leaves), the
    choice codes by length (1 keep, 2 drop-cheap, 3 region) and what a region's split needs.
    With this layout every table a length needs is a strided view: nothing is gathered."""

    k: int
    t0: np.ndarray
    t1: np.ndarray
    r1: np.ndarray
    choice: list[np.ndarray]
    fsum: np.ndarray
    f0: I64  # a region's first forward at top level (the user's Python runs it)
    f0r: I64  # the same replayed inside an enclosing region's replay
    gb: I64
    x: I64
    xbar: I64
    xsac: I64
    dprev: I64

    def gf(self, t: np.ndarray | int) -> np.ndarray:
        """Gradient bytes held during a forward whose enclosing sequence ends at stage t (a
        region's replay: gb_t plus the unsaved part of its output, d_t, which gb counts as
        resident; chain._run)."""
        return np.where(np.asarray(t) == self.k - 1, 0, self.gb[t])

    def diag(self, table: np.ndarray, t: int, s: int, rows: int, jumps: int = 0) -> np.ndarray:
        """View of table[t + i + j, s + i] (i < rows, j < jumps when jumps) as [(j,) i, m]."""
        st, ss, sm = table.strides
        shape = (rows, table.shape[2]) if not jumps else (jumps, rows, table.shape[2])
        strides = (st + ss, sm) if not jumps else (st, st + ss, sm)
        return np.lib.stride_tricks.as_strided(table[t, s], shape, strides)

    def regions(self, s0: int, ns: int, length: int, out: np.ndarray,
                mask: np.ndarray) -> np.ndarray:
        """out[j-1, i, m]: cost of region s..s+j-1 then the rest s+j..s+length-1, for
        s = s0 + i and j = 1..length-1 (inf where the region's forward does not fit)."""
        s = np.arange(s0, s0 + ns)
        jj = np.arange(1, length)[:, None]
        fs = (self.fsum[s[None, :] + jj] - self.fsum[s][None, :])[:, :, None]
        np.add(fs, self._rest(s0, ns, length), out=out)
        out += self.diag(self.t0, s0, s0, ns, length - 1)
        f0 = np.where(s + length - 1 == self.k - 1, self.f0[1:length, s], self.f0r[1:length, s])
        need = self.gf(s + length - 1)[None, :] + f0
        np.less(np.arange(out.shape[2])[None, None, :], need[:, :, None], out=mask)
        np.copyto(out, INF, where=mask)
        return out

    def _rest(self, s0: int, ns: int, length: int) -> np.ndarray:
        """r1[s + length - 1, s + j] as [j-1, i, m]: t fixed per i, start s + j."""
        st, ss, sm = self.r1.strides
        return np.lib.stride_tricks.as_strided(
            self.r1[s0 + length - 1, s0 + 1], (length - 1, ns, self.r1.shape[2]),
            (ss, st + ss, sm))


def solve(c: Chain, avail_bytes: int, slots: int = 256, slot_bytes: int | None = None,
          cost: np.ndarray | None = None, allow_drop_cheap: bool = True
          ) -> tuple[float, tuple[Item, ...] | None]:
    """(forward cost executed, schedule) of the cheapest schedule fitting ``avail_bytes`` above
    the base; (inf, None) when none does. ``cost``: per-stage forward cost (default FLOPs)."""
    k = c.n
    if avail_bytes < 0:
        return INF, None
    slot = slot_bytes or max(1, -(-avail_bytes // slots))
    mm = avail_bytes // slot
    f = (c.f if cost is None else np.asarray(cost)).astype(np.float64)
    fc = c.fcheap.astype(np.float64) if cost is None else f * (c.fcheap / np.maximum(c.f, 1))
    x, xbar, xsac = _slots(c.x, slot), _slots(c.xbar, slot), _slots(c.xsac, slot)
    dprev = np.concatenate(([0], c.d[:-1])) // slot  # a credit: rounded down
    need_b = _slots(c.xbar + c.gb + c.tb, slot)
    need_bs = _slots(c.need_sac_b, slot)
    tf, tfr, tfs = _slots(c.tf, slot), _slots(c.tf_replay, slot), _slots(c.tf_sac, slot)
    f0, f0r = (_region_forward(_slots(t0, slot), x, k) for t0 in (c.tf0, c.tf0_replay))
    shape = (k, k, mm + 1)  # only t >= s is ever written or read: no need to initialise
    tab = _Tables(k, np.empty(shape), np.empty(shape), np.empty(shape),
                  [np.zeros(0, dtype=np.int8)], np.concatenate(([0.0], np.cumsum(f))), f0, f0r,
                  _slots(c.gb + c.d, slot), x, xbar, xsac, dprev)
    rows = max(((n - 1) * (k - n + 1) for n in range(1, k + 1)), default=0)
    work = np.empty(rows * (mm + 1))
    mask = np.empty(rows * (mm + 1), dtype=np.bool_)
    mgrid = np.arange(mm + 1)
    for length in range(1, k + 1):  # all (s, t = s+length-1) at once
        ns = k - length + 1
        s_idx = np.arange(ns)
        t_idx = s_idx + length - 1
        gf = tab.gf(t_idx)
        best = np.full((ns, 2, mm + 1), INF)
        arg = np.ones((ns, 2, mm + 1), dtype=np.int8)
        rest1 = tab.diag(tab.t1, length - 1, 1, ns) if length > 1 else None
        tf_s = np.where(t_idx == k - 1, tf[:ns], tfr[:ns])  # inside a region: a replay
        for dr in (0, 1):  # keep s
            need = np.maximum(gf + tf_s, need_b[:ns] - dr * dprev[:ns])
            ok = mgrid[None, :] >= need[:, None]
            if rest1 is None:
                best[:, dr] = np.where(ok, f[:ns, None], INF)
            else:
                cand = f[:ns, None] + _shifted(rest1, xbar[:ns] - dr * dprev[:ns])
                best[:, dr] = np.where(ok, cand, INF)
        candidates: list[tuple[np.ndarray, int]] = []
        if allow_drop_cheap:  # drop-cheap s: top level (t = K-1) only
            top = t_idx == k - 1
            need = np.maximum(gf + tfs[:ns], need_bs[:ns])
            ok = (mgrid[None, :] >= need[:, None]) & top[:, None]
            if rest1 is None:
                candidates.append((np.where(ok, (f + fc)[:ns, None], INF), 2))
            else:
                rest = _shifted(rest1, xsac[:ns])
                candidates.append((np.where(ok, (f + fc)[:ns, None] + rest, INF), 2))
        if length > 1:  # regions s..s+j-1 for every j; which j is recovered on rebuild
            size = (length - 1) * ns * (mm + 1)
            out = work[:size].reshape(length - 1, ns, mm + 1)
            m3 = mask[:size].reshape(length - 1, ns, mm + 1)
            candidates.append((tab.regions(0, ns, length, out, m3).min(axis=0), 3))
        for cand, code in candidates:  # strictly better only: ties keep the earlier choice
            for dr in (0, 1):
                better = cand < best[:, dr]
                best[:, dr] = np.where(better, cand, best[:, dr])
                np.putmask(arg[:, dr], better, code)
        tab.diag(tab.t0, length - 1, 0, ns)[...] = best[:, 0]
        tab.diag(tab.t1, length - 1, 0, ns)[...] = best[:, 1]
        if ns > 1:  # r1[t, s] = t1[t, s] shifted by x_{s-1}
            tab.diag(tab.r1, length, 1, ns - 1)[...] = _shifted(best[1:, 1], x[: ns - 1])
        tab.choice.append(arg)
    total = float(tab.t0[k - 1, 0, mm])
    if total == INF:
        return INF, None
    return total, _rebuild(tab, 0, k - 1, 0, int(mm))


def _region_forward(tf0: I64, x: I64, k: int) -> I64:
    """f0[j, s]: the forward need of region s..s+j-1 (nothing saved; inputs of later stages
    held)."""
    f0 = np.zeros((k + 1, k), dtype=np.int64)
    f0[1] = tf0
    for j in range(2, k):
        f0[j, : k - j + 1] = np.maximum(f0[j - 1, : k - j + 1], tf0[j - 1 :] + x[j - 2 : k - 1])
    return f0


def _shifted(row: np.ndarray, shift: I64) -> np.ndarray:
    """row[s, m - shift[s]] for every m (inf where negative; capped at the top slot)."""
    mm = row.shape[1] - 1
    idx = np.arange(mm + 1)[None, :] - shift[:, None]
    out = np.take_along_axis(row, np.clip(idx, 0, mm), axis=1)
    return np.where(idx < 0, INF, out)


def _rebuild(tab: _Tables, s: int, t: int, dr: int, m: int) -> tuple[Item, ...]:
    items: list[Item] = []
    top = tab.t0.shape[2] - 1
    while s <= t:
        code = int(tab.choice[t - s + 1][s, dr, m])
        if code == 1:
            items.append(Keep(s))
            m = min(m - int(tab.xbar[s]) + dr * int(tab.dprev[s]), top)
            s, dr = s + 1, 1
        elif code == 2:
            items.append(DropCheap(s))
            m -= int(tab.xsac[s])
            s, dr = s + 1, 1
        else:  # the least j, as the table's strict comparisons chose it
            n = t - s + 1
            out = np.empty((n - 1, 1, top + 1))
            cand = tab.regions(s, 1, n, out, np.empty(out.shape, dtype=np.bool_))[:, 0, m]
            j = int(np.argmin(cand)) + 1
            body = _rebuild(tab, s, s + j - 1, 0, m)
            items.append(Region(s, s + j - 1, body))
            m -= int(tab.x[s + j - 1])
            s, dr = s + j, 1
    return tuple(items)


def expand(items: tuple[Item, ...], groups: list[tuple[int, int]]) -> tuple[Item, ...]:
    """A schedule over groups as a schedule over the original stages."""
    out: list[Item] = []
    for it in items:
        if isinstance(it, Keep):
            out.extend(Keep(s) for s in range(groups[it.stage][0], groups[it.stage][1] + 1))
        elif isinstance(it, DropCheap):
            out.extend(DropCheap(s) for s in range(groups[it.stage][0], groups[it.stage][1] + 1))
        else:
            out.append(Region(groups[it.start][0], groups[it.end][1], expand(it.body, groups)))
    return tuple(out)


def plan_optimal(graph: ChainLike, budget_bytes: int | None = None, max_stages: int = 100,
                 slots: int = 256, drop_cheap: bool = True,
                 stage_time_s: list[float] | None = None) -> Plan:
    """Least recomputation (FLOPs, or measured time with ``stage_time_s``) under the budget;
    without a budget, the least peak found (a bisection over budgets)."""
    chain = as_chain(graph)
    max_stages = int_param("max_stages", max_stages, 2, "Use e.g. max_stages=100.")
    slots = int_param("slots", slots, 8, "Use e.g. slots=256.")
    if stage_time_s is not None and len(stage_time_s) != chain.n:
        raise bad_arg("stage_time_s", f"{chain.n} forward times (one per stage)",
                      len(stage_time_s), "Measure each stage of this graph's chain.")
    coarse, groups = coarsen(chain, max_stages)
    cost = None
    if stage_time_s is not None:
        cost = np.array([sum(stage_time_s[a : b + 1]) for a, b in groups])
    params = {"max_stages": max_stages, "slots": slots, "drop_cheap": drop_cheap,
              "objective": "flops" if cost is None else "time"}
    notes: tuple[str, ...] = () if coarse is chain else (
        f"{chain.n} stages merged into {coarse.n} groups for speed (max_stages)",)

    def done(schedule: tuple[Item, ...], extra: tuple[str, ...] = ()) -> Plan:
        plan = make_plan(chain, schedule, "optimal", params, budget_bytes, notes + extra,
                         stage_time_s)  # predicted_time_s from the measured times, if any
        if budget_bytes is not None and plan.peak_bytes > budget_bytes:
            raise budget_too_small(budget_bytes, plan.peak_bytes, "optimal")
        return plan

    if budget_bytes is None:
        return done(least_peak_plan(chain, coarse, groups, slots, drop_cheap, cost).schedule)
    _, sch = solve(coarse, budget_bytes - chain.base_bytes, slots, cost=cost,
                   allow_drop_cheap=drop_cheap)
    if sch is None:
        least = least_peak_plan(chain, coarse, groups, slots, drop_cheap, cost)
        if least.peak_bytes > budget_bytes:
            raise budget_too_small(budget_bytes, least.peak_bytes, "optimal")
        return done(least.schedule, ("slot rounding: the least-peak plan is returned",))
    return done(expand(sch, groups))


def least_peak_plan(chain: Chain, coarse: Chain, groups: list[tuple[int, int]], slots: int,
                    drop_cheap: bool, cost: np.ndarray | None, steps: int = 10) -> Plan:
    """The lowest-peak plan the program finds: bisection on the budget."""
    lo, hi = 0, int(simulate(chain, plain_schedule(chain))[0]) - chain.base_bytes
    best = plain_schedule(coarse)
    for _ in range(steps):
        mid = (lo + hi) // 2
        _, sch = solve(coarse, mid, slots, cost=cost, allow_drop_cheap=drop_cheap)
        if sch is None:
            lo = mid + 1
        else:
            hi, best = mid, sch
    return make_plan(chain, expand(best, groups), "optimal", {}, None)
