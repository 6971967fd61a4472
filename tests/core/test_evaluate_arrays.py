"""The evaluator on arrays (``core.eval_arrays``, ``core.scopes``, ``core.replay_intervals``)
against the op-by-op walk it replaced: ``data/evaluations.json`` holds what main's walk (at
3a269b3) gave for explicit schedules on the stored graphs (regions, nested regions, one
nested past its parent's start, drop-cheap stages), peak and where, to the byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.core import chain as C
from memplan.core import fit
from memplan.core import graph_arrays as GA
from memplan.core import schedule as S
from memplan.core.evaluate import evaluate, idle_scopes
from memplan.core.graph import Graph
from memplan.core.plan import Plan, make_plan
from memplan.core.planners import PLANNERS
from tests.core.graphs import NAMES, tiny

EXPECTED = json.loads((Path(__file__).parent / "data" / "evaluations.json").read_text())
SCHEDULES = ("pairs", "drop-cheap", "nested", "mixed")


def _body(lo: int, hi: int) -> tuple[S.Item, ...]:
    return tuple(S.Keep(s) for s in range(lo, hi + 1))


def scheduled(graph: Graph, kind: str) -> Plan:
    """A plan of ``graph`` with schedule ``kind`` over its model's stages (the last stage,
    holding the loss, kept)."""
    chain = C.build_chain(graph)
    last = chain.n - 1
    items: list[S.Item] = []
    if kind == "pairs":  # every two stages a region
        items = [S.Region(s, s + 1, _body(s, s + 1)) for s in range(0, last - 1, 2)]
    elif kind == "drop-cheap":
        items = [S.DropCheap(s) for s in range(last)]
    elif kind == "nested":  # regions in regions, as the recursive planner makes them
        half = max(last // 2, 1)
        inner = S.Region(0, half // 2, _body(0, half // 2))
        items = [S.Region(0, half, (inner, *_body(half // 2 + 1, half)))]
    elif kind == "mixed" and last >= 4:  # a drop-cheap stage; a region nested past its start
        inner = S.Region(2, last - 2, _body(2, last - 2))
        items = [S.DropCheap(0), S.Region(1, last - 1, (S.Keep(1), inner, S.Keep(last - 1)))]
    done = max((S.item_end(it) for it in items), default=-1)
    schedule = (*items, *_body(done + 1, last))
    return make_plan(chain, schedule, "explicit", {}, None)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", SCHEDULES)
def test_evaluations_equal_the_walks(name: str, kind: str) -> None:
    graph = tiny(name)
    ev = evaluate(graph, scheduled(graph, kind))
    assert [ev.peak_bytes, ev.forward_peak_bytes, ev.peak_at] == EXPECTED[f"{name}/{kind}"]


@pytest.mark.parametrize("name", NAMES)
def test_cold_and_warm_evaluations_agree(name: str) -> None:
    """Whether the evaluator's arrays come from the Graph's objects, share the chain's
    (``graph_arrays``), or are cached, the evaluation is the same."""
    graph = tiny(name)
    plan = scheduled(graph, "pairs")
    GA._ARRAYS.clear()  # nothing derived from the graph yet
    cold = evaluate(graph, plan)
    GA._ARRAYS.clear()
    GA.graph_arrays(graph)  # the chain's arrays first
    assert evaluate(graph, plan) == cold
    assert evaluate(graph, plan) == cold
    other = tiny("gpt" if name != "gpt" else "lstm")  # another graph's arrays in the cache
    evaluate(other, scheduled(other, "pairs"))
    assert evaluate(graph, plan) == cold


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("planner", ["sqrt", "recursive", "drop-cheap", "optimal"])
def test_evaluated_plans_are_their_pruned_plans_evaluated(name: str, planner: str) -> None:
    """``fit._evaluated`` evaluates the scopes it found idle ones in when none is: the same
    peak as evaluating the pruned plan afresh."""
    graph = tiny(name)
    plan = PLANNERS[planner](C.build_chain(graph), None)
    pruned = fit._pruned(graph, plan)
    assert (pruned is plan) == (not idle_scopes(graph, plan))
    ev = evaluate(graph, pruned)
    assert fit._evaluated(graph, plan).peak_bytes == ev.peak_bytes
