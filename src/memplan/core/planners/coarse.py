"""Merging consecutive stages into groups: a coarser chain for planners that cannot take every
stage (``ilp``'s MILP; ``optimal`` with ``max_stages``). A group runs as its stages run plainly
(keep), as one region, or as drop-cheap stages one by one."""

from __future__ import annotations

import numpy as np

from memplan.core.chain import Chain
from memplan.core.schedule import DropCheap, Item, Keep, Region


def coarsen(c: Chain, max_stages: int) -> tuple[Chain, list[tuple[int, int]]]:
    """Merge consecutive stages into at most ``max_stages`` groups of similar kept bytes."""
    k = c.n
    if k <= max_stages:
        return c, [(s, s) for s in range(k)]
    weight = np.cumsum(np.maximum(c.xbar, 1)).astype(np.float64)
    marks = np.searchsorted(weight, weight[-1] * np.arange(1, max_stages) / max_stages)
    ends = np.unique(np.append(marks[marks < k - 1], k - 1))
    groups, lo = [], 0
    for e in ends.tolist():
        groups.append((lo, e))
        lo = e + 1
    return merge(c, groups), groups


def merge(c: Chain, groups: list[tuple[int, int]]) -> Chain:
    """The chain whose stages are the groups; each group behaves as its stages run plainly
    (keep), as one region (region forward), or as drop-cheap stages one by one."""
    dprev = np.concatenate(([0], c.d[:-1]))
    out: dict[str, list[int]] = {n: [] for n in ("f", "b", "x", "xbar", "d", "xsac", "xsac_b",
                                                 "fcheap", "tf", "tf0", "tb", "gb", "tfr",
                                                 "tfr0", "tfs", "xh")}
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
            "tfs": int(np.max(xs[:-1] + c.tf_sac[a : b + 1])), "xh": int(c.held_end[b]),
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
        tfs=arr["tfs"], xh=arr["xh"],
    )


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
