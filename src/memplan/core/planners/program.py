"""The optimal planner's program for one chain (``planners.optimal``): the stage table, the
classes of identical sub-chains (``Shape``: what does not depend on the budget), the filled
frontiers and the schedule read back from them (``Program``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memplan.core.chain import Chain
from memplan.core.planners import frontier as F
from memplan.core.planners.body_bounds import fill_bounds, item_kinds
from memplan.core.planners.priced import Relaxation, relax
from memplan.core.planners.repeats import classes, stage_types
from memplan.core.schedule import DropCheap, Item, Keep, Region

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]


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
class Shape:
    """What does not depend on the budget: the table and its classes of identical sub-chains."""

    st: I64
    cid: I32
    min_gb: I64
    allow_dc: bool

    @classmethod
    def of(cls, st: I64, allow_dc: bool, share: bool = True) -> Shape:
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
             by_need: tuple[I64, I64] | None = None) -> Program:
        """The program for ``free`` bytes; ``cost_caps``: (top-level caps, inner slack);
        ``by_need``: caps by free bytes for every row (``priced``)."""
        st = self.st
        mcap = min(free + self.credit(), F.BIG // 4)
        top, inner = cost_caps or (np.full(st.shape[1], F.BIG // 4, dtype=np.int64), F.BIG // 4)
        caps, ctab = by_need or (np.zeros((0, 3), np.int64), np.zeros((0, 2, 2), np.int64))
        pool, tab = F.fill(st, self.cid, mcap - self.min_gb, mcap, top, inner, self.allow_dc,
                           caps, ctab)
        return Program(st, self.cid, len(self.min_gb), pool, tab)

    def relax(self, free: int, upper: int) -> Relaxation:
        """The priced relaxation among plans costing at most ``upper`` (``priced``)."""
        mcap = min(free + self.credit(), F.BIG // 4)
        bodies = fill_bounds(self.st, self.cid, mcap - self.min_gb, item_kinds(self.st))
        return relax(self.st, self.cid, bodies, free, self.credit(), upper, self.allow_dc)


@dataclass(frozen=True)
class Program:
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


def least_need(shape: Shape) -> int:
    """The fewest free bytes (units) any schedule needs (``frontier.BIG``: none fits)."""
    return int(F.least_need(shape.st, shape.cid, len(shape.min_gb), shape.allow_dc))
