"""Schedules over a chain and their cost model: which stages are kept, drop-cheap, or inside
(nested) recompute regions, and ``simulate``, the peak bytes and FLOPs of a schedule: the model
the optimal planner optimises (``memplan.core.chain`` holds the per-stage costs).

* ``Keep(s)``: run plainly, autograd keeps what it saves (m = 0);
* ``DropCheap(s)``: outputs of expensive ops (conv, matmul) kept, cheap ones recomputed in
  backward (Sec. 4.2);
* ``Region(s, e, body)``: only its input is kept; in backward the body is re-run (nested
  regions inside it again only keep their inputs) and backpropagated (Alg. 1, Sec. 4.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.core.chain import Chain
from memplan.errors import PlanInvalid


@dataclass(frozen=True)
class Keep:
    stage: int


@dataclass(frozen=True)
class DropCheap:
    stage: int


@dataclass(frozen=True)
class Region:
    start: int
    end: int  # inclusive
    body: tuple[Item, ...]


Item = Keep | DropCheap | Region


def item_start(it: Item) -> int:
    return it.start if isinstance(it, Region) else it.stage


def item_end(it: Item) -> int:
    return it.end if isinstance(it, Region) else it.stage


def simulate(chain: Chain, schedule: tuple[Item, ...]) -> tuple[int, int]:
    """(peak bytes, forward FLOPs executed incl. recomputation) of a schedule: the model the
    optimal planner optimises, evaluated in exact bytes."""
    validate(chain, schedule)
    peak, flops = _run(chain, schedule, 0, chain.base_bytes, False, 0, False)
    return peak, flops


def _run(c: Chain, items: tuple[Item, ...], pos: int, used: int, droppable: bool,
         gfwd: int, replay: bool) -> tuple[int, int]:
    """Forward through the items in order, then each item's backward (nesting recurses);
    ``replay``: inside a region's body, which the runtime replays in backward."""
    peak, flops = -(1 << 62), 0
    tf = c.tf_replay if replay else c.tf
    tf0 = c.tf0_replay if replay else c.tf0
    for it in items[pos:]:
        if isinstance(it, Keep):
            s = it.stage
            freed = int(c.d[s - 1]) if droppable and s > 0 else 0
            now = used + int(c.xbar[s]) - freed
            peak = max(peak, used + gfwd + int(tf[s]), now + int(c.gb[s] + c.tb[s]))
            flops += int(c.f[s])
        elif isinstance(it, DropCheap):
            s = it.stage
            now = used + int(c.xsac[s])
            peak = max(peak, used + gfwd + int(c.tf_sac[s]), used + int(c.need_sac_b[s]))
            flops += int(c.f[s] + c.fcheap[s])
        else:
            s, e = it.start, it.end
            fwd = max(int(tf0[k]) + (int(c.x[k - 1]) if k > s else 0) for k in range(s, e + 1))
            if not replay:  # the user's code still holds what it saved: the next forward
                fwd = max(fwd, region_exit(c, e))
            now = used + int(c.x[e])
            # Gradient bytes when the region replays: gb counts the unsaved part of its output
            # (d) as resident, but it was freed in the forward.
            p_body, f_body = _run(c, it.body, 0, used, False, int(c.gb[e] + c.d[e]), True)
            peak = max(peak, used + gfwd + fwd, p_body)
            f_region = int(c.f[s : e + 1].sum())
            # A top-level replay stops early (Chain.fstop); nested ones are counted whole.
            skip = int(c.fstop[e]) if c.fstop is not None and not replay else 0
            flops += f_region + f_body - min(skip, f_region)
        used, droppable = now, True
    return peak, flops


def region_exit(c: Chain, e: int) -> int:
    """Bytes above a top-level region's start while the stage after its end e runs forward
    (any mode): its checkpoint, plus what the region saved that the user's code still holds
    (``Chain.xh``: the tape does not keep it, the user's code does, for that stage); 0 when
    there is none (the next stage's own need covers it)."""
    if e + 1 >= c.n or c.held_end[e] == 0:
        return 0
    nxt = max(int(c.tf[e + 1]), int(c.tf0[e + 1]), int(c.tf_sac[e + 1]))
    return int(c.x[e]) + int(c.held_end[e]) + nxt


def validate(chain: Chain, schedule: tuple[Item, ...], start: int = 0, end: int | None = None,
             top: bool = True) -> None:
    """Items must tile stages start..end in order; regions never end a sequence; drop-cheap
    only at top level (a selective region nested in a recomputed one would keep its cache)."""
    end = chain.n - 1 if end is None else end
    pos = start
    for i, it in enumerate(schedule):
        if item_start(it) != pos or item_end(it) < item_start(it):
            raise PlanInvalid(f"schedule does not tile stages {start}..{end} at item {i}: {it}")
        if isinstance(it, Region):
            if i == len(schedule) - 1:
                raise PlanInvalid(f"a recompute region cannot end its sequence: {it}")
            validate(chain, it.body, it.start, it.end, top=False)
        if isinstance(it, DropCheap) and not top:
            raise PlanInvalid(f"drop-cheap stage {it.stage} is nested in a recompute region")
        pos = item_end(it) + 1
    if pos != end + 1:
        raise PlanInvalid(f"schedule covers stages {start}..{pos - 1}, expected ..{end}")


def plain_schedule(chain: Chain) -> tuple[Item, ...]:
    return tuple(Keep(s) for s in range(chain.n))


def to_dict(it: Item) -> dict[str, Any]:
    if isinstance(it, Keep):
        return {"kind": "keep", "stage": it.stage}
    if isinstance(it, DropCheap):
        return {"kind": "drop-cheap", "stage": it.stage}
    return {"kind": "recompute", "start": it.start, "end": it.end,
            "body": [to_dict(b) for b in it.body]}


def from_dict(d: dict[str, Any]) -> Item:
    kind = d["kind"]
    if kind == "keep":
        return Keep(int(d["stage"]))
    if kind == "drop-cheap":
        return DropCheap(int(d["stage"]))
    return Region(int(d["start"]), int(d["end"]), tuple(from_dict(b) for b in d["body"]))
