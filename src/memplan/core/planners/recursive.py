"""``recursive``: Sec. 4.4: keep k checkpoints, split into k + 1 parts, recurse into each
recomputed part; memory g(n) = k log_{k+1} n, k = 1 gives O(log n) at O(log n) forwards."""

from __future__ import annotations

from memplan.core import schedule as S
from memplan.core.plan import Plan
from memplan.core.planners.common import ChainLike, as_chain, finish, int_param, segments_by_weight


def plan_recursive(graph: ChainLike, budget_bytes: int | None = None, k: int = 1) -> Plan:
    chain = as_chain(graph)
    k = int_param("k", k, 1, "Use k=1 for O(log n) memory, larger k for fewer recomputations.")
    weights = [int(v) for v in chain.xbar]
    return finish(chain, _split(weights, 0, chain.n - 1, k), "recursive", {"k": k}, budget_bytes)


def _split(weights: list[int], a: int, b: int, k: int) -> tuple[S.Item, ...]:
    if a == b:
        return (S.Keep(a),)
    parts = [(a + lo, a + hi) for lo, hi in segments_by_weight(weights[a : b + 1], k + 1)]
    items: list[S.Item] = []
    for lo, hi in parts[:-1]:
        items.append(S.Region(lo, hi, _split(weights, lo, hi, k)))
    items.extend(_split(weights, parts[-1][0], parts[-1][1], k))
    return tuple(items)
