"""Shared by the planners: the chain of a graph, budget checks, plan wrapping."""

from __future__ import annotations

from typing import Any

from memplan.core import chain as C
from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.budget import budget_too_small
from memplan.core.plan import Plan, make_plan
from memplan.errors import bad_arg

ChainLike = g.Graph | C.Chain

# The dynamic program plans through every cut point of a graph up to this many (core.fit,
# and ilp beside its own chain): cut points that are not clean boundaries (a skip held
# across them) can still lower the peak, and the evaluation judges.
ALL_CUTS = 400


def as_chain(obj: ChainLike) -> C.Chain:
    if isinstance(obj, C.Chain):
        return obj
    if isinstance(obj, g.Graph):
        return C.build_chain(obj)
    raise bad_arg("graph", "a memplan Graph or Chain", type(obj).__name__,
                  "Capture one with memplan.capture(...).")


def finish(chain: C.Chain, schedule: tuple[S.Item, ...], planner: str, params: dict[str, Any],
           budget_bytes: int | None, notes: tuple[str, ...] = ()) -> Plan:
    """Wrap a schedule; raise BudgetTooSmall when it does not fit."""
    plan = make_plan(chain, schedule, planner, params, budget_bytes, notes)
    if budget_bytes is not None and plan.peak_bytes > budget_bytes:
        raise budget_too_small(budget_bytes, plan.peak_bytes, planner)
    return plan


def int_param(name: str, value: object, lo: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise bad_arg(name, f"an integer >= {lo}", value, fix)
    return value


def segments_by_weight(weights: list[int], n_segments: int) -> list[tuple[int, int]]:
    """Split 0..len-1 into n contiguous segments of similar total weight (Alg. 1 segments
    balanced by bytes, not just by count)."""
    k = len(weights)
    n_segments = max(1, min(n_segments, k))
    total = sum(max(w, 1) for w in weights)
    out: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for s in range(k):
        acc += max(weights[s], 1)
        remaining_stages = k - s - 1
        remaining_segs = n_segments - len(out) - 1
        if remaining_segs <= 0:
            continue
        if acc * n_segments >= total * (len(out) + 1) or remaining_stages == remaining_segs:
            out.append((lo, s))
            lo = s + 1
    out.append((lo, k - 1))
    return out


def segmented(segments: list[tuple[int, int]]) -> tuple[S.Item, ...]:
    """Every segment but the last a recompute region (body plain); the last kept (Alg. 1)."""
    items: list[S.Item] = []
    for a, b in segments[:-1]:
        items.append(S.Region(a, b, tuple(S.Keep(s) for s in range(a, b + 1))))
    a, b = segments[-1]
    items.extend(S.Keep(s) for s in range(a, b + 1))
    return tuple(items)
