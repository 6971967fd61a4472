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

import numpy as np

from memplan.budget import BudgetTooSmall
from memplan.chain import I64, Chain, DropCheap, Item, Keep, Region, plain_schedule, simulate
from memplan.errors import bad_arg
from memplan.plan import Plan, make_plan
from memplan.planners.common import ChainLike, as_chain, finish, int_param

INF = np.inf


def coarsen(c: Chain, max_stages: int) -> tuple[Chain, list[tuple[int, int]]]:
    """Merge consecutive stages into at most ``max_stages`` groups of similar kept bytes."""
    k = c.n
    if k <= max_stages:
        return c, [(s, s) for s in range(k)]
    weight = np.cumsum(np.maximum(c.xbar, 1)).astype(np.float64)
    marks = np.searchsorted(weight, weight[-1] * np.arange(1, max_stages) / max_stages)
    ends = sorted(set(int(m) for m in marks if m < k - 1) | {k - 1})
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
                                                 "fcheap", "tf", "tf0", "tb", "gb")}
    for a, b in groups:
        own = c.xbar[a : b + 1] - np.concatenate(([0], dprev[a + 1 : b + 1]))
        res = np.concatenate(([0], np.cumsum(own)))
        xs = np.concatenate(([0], np.cumsum(c.xsac[a : b + 1])))
        tf = int(np.max(res[:-1] + c.tf[a : b + 1]))
        xin = np.concatenate(([0], c.x[a:b]))
        peak_b = int(np.max(res[1:] + c.gb[a : b + 1] + c.tb[a : b + 1]))
        peak_sac = int(np.max(xs[:-1] + c.xsac_b[a : b + 1] + c.gb[a : b + 1] + c.tb[a : b + 1]))
        gb = int(c.gb[b])
        tb = peak_b - int(res[-1]) - gb
        vals = {
            "f": int(c.f[a : b + 1].sum()), "b": int(c.b[a : b + 1].sum()), "x": int(c.x[b]),
            "xbar": int(res[-1]), "d": int(c.d[b]), "xsac": int(xs[-1]),
            "xsac_b": peak_sac - gb - tb, "fcheap": int(c.fcheap[a : b + 1].sum()), "tf": tf,
            "tf0": int(np.max(c.tf0[a : b + 1] + xin)), "tb": tb, "gb": gb,
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
        tf0=arr["tf0"], tb=arr["tb"], gb=arr["gb"],
    )


def _slots(v: I64, slot: int) -> I64:
    return -(-v // slot)  # ceil, also for negatives


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
    fsum = np.concatenate(([0.0], np.cumsum(f)))
    x, xbar, xsac = _slots(c.x, slot), _slots(c.xbar, slot), _slots(c.xsac, slot)
    dprev = np.concatenate(([0], c.d[:-1])) // slot  # a credit: rounded down
    need_b = _slots(c.xbar + c.gb + c.tb, slot)
    need_bs = _slots(c.xsac_b + c.gb + c.tb, slot)
    gb = _slots(c.gb, slot)
    tf, tf0 = _slots(c.tf, slot), _slots(c.tf0, slot)
    # F0[j][s]: forward need of region s..s+j-1 run without saving.
    f0 = [np.zeros(0, dtype=np.int64), tf0.copy()]
    for j in range(2, k):
        prev = f0[-1][: k - j + 1]
        f0.append(np.maximum(prev, tf0[j - 1 :] + x[j - 2 : k - 1]))
    mgrid = np.arange(mm + 1)
    table: list[np.ndarray] = [np.zeros(0)]
    choice: list[np.ndarray] = [np.zeros(0, dtype=np.int32)]
    for length in range(1, k + 1):
        ns = k - length + 1
        s_idx = np.arange(ns)
        t_idx = s_idx + length - 1
        gf = np.where(t_idx == k - 1, 0, gb[t_idx])
        best = np.full((ns, 2, mm + 1), INF)
        arg = np.zeros((ns, 2, mm + 1), dtype=np.int32)
        for dr in (0, 1):  # keep s
            store = xbar[:ns] - dr * dprev[:ns]
            need = np.maximum(gf + tf[:ns], need_b[:ns] - dr * dprev[:ns])
            ok = mgrid[None, :] >= need[:, None]
            if length == 1:
                cand = np.where(ok, f[:ns, None], INF)
            else:
                cand = f[:ns, None] + _shifted(table[length - 1][1 : ns + 1, 1], store)
                cand = np.where(ok, cand, INF)
            best[:, dr], arg[:, dr] = cand, 1
        if allow_drop_cheap and length <= k:  # drop-cheap s: top level (t = K-1) only
            top = t_idx == k - 1
            need = np.maximum(gf + tf[:ns], need_bs[:ns])
            ok = (mgrid[None, :] >= need[:, None]) & top[:, None]
            if length == 1:
                cand = np.where(ok, (f + fc)[:ns, None], INF)
            else:
                rest = _shifted(table[length - 1][1 : ns + 1, 1], xsac[:ns])
                cand = np.where(ok, (f + fc)[:ns, None] + rest, INF)
            for dr in (0, 1):
                better = cand < best[:, dr]
                best[:, dr] = np.where(better, cand, best[:, dr])
                arg[:, dr] = np.where(better, 2, arg[:, dr])
        for j in range(1, length):  # region s..s+j-1
            e_idx = s_idx + j - 1
            ok = mgrid[None, :] >= (gf + f0[j][:ns])[:, None]
            rest = _shifted(table[length - j][j : j + ns, 1], x[e_idx])
            cand = (fsum[e_idx + 1] - fsum[s_idx])[:, None] + rest + table[j][:ns, 0]
            cand = np.where(ok, cand, INF)
            for dr in (0, 1):
                better = cand < best[:, dr]
                best[:, dr] = np.where(better, cand, best[:, dr])
                arg[:, dr] = np.where(better, 2 + j, arg[:, dr])
        table.append(best)
        choice.append(arg)
    total = float(table[k][0, 0, mm])
    if total == INF:
        return INF, None
    return total, _rebuild(choice, x, xbar, xsac, dprev, 0, k - 1, 0, int(mm), k)


def _shifted(row: np.ndarray, shift: I64) -> np.ndarray:
    """row[s, m - shift[s]] for every m (inf where negative; capped at the top slot)."""
    mm = row.shape[1] - 1
    idx = np.arange(mm + 1)[None, :] - shift[:, None]
    out = np.take_along_axis(row, np.clip(idx, 0, mm), axis=1)
    return np.where(idx < 0, INF, out)


def _rebuild(choice: list[np.ndarray], x: I64, xbar: I64, xsac: I64, dprev: I64, s: int, t: int,
             dr: int, m: int, k: int) -> tuple[Item, ...]:
    items: list[Item] = []
    while s <= t:
        code = int(choice[t - s + 1][s, dr, m])
        if code == 1:
            items.append(Keep(s))
            m = min(m - int(xbar[s]) + dr * int(dprev[s]), len(choice[1][0, 0]) - 1)
            s, dr = s + 1, 1
        elif code == 2:
            items.append(DropCheap(s))
            m -= int(xsac[s])
            s, dr = s + 1, 1
        else:
            j = code - 2
            body = _rebuild(choice, x, xbar, xsac, dprev, s, s + j - 1, 0, m, k)
            items.append(Region(s, s + j - 1, body))
            m -= int(x[s + j - 1])
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
    if budget_bytes is None:
        plan = least_peak_plan(chain, coarse, groups, slots, drop_cheap, cost)
        return finish(chain, plan.schedule, "optimal", params, None, notes)
    _, sch = solve(coarse, budget_bytes - chain.base_bytes, slots, cost=cost,
                   allow_drop_cheap=drop_cheap)
    if sch is None:
        least = least_peak_plan(chain, coarse, groups, slots, drop_cheap, cost)
        if least.peak_bytes > budget_bytes:
            raise BudgetTooSmall(budget_bytes, least.peak_bytes, "optimal")
        notes += ("slot rounding: the least-peak plan is returned",)
        return finish(chain, least.schedule, "optimal", params, budget_bytes, notes)
    return finish(chain, expand(sch, groups), "optimal", params, budget_bytes, notes)


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
