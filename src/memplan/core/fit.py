"""A budget is a promise: plans are held to their evaluated peak (``memplan.core.evaluate``:
the runtime's own semantics on the captured graph), never to the chain model's estimate alone.

``fit`` runs a planner, evaluates its plan, and when the evaluated peak exceeds the budget
plans again under a budget tightened by the overshoot (a few times, deterministically), then
tries the planner's least-peak plan; when nothing fits it refuses, naming the least peak each
planner reaches and the one to use. A plan that evaluates well below its budget (the chain
model over-counts some steps) is planned again at a raised target, for less recomputation.
Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from memplan.core import chain as C
from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.budget import budget_too_small, format_bytes
from memplan.core.evaluate import (
    evaluate,
    evaluate_scopes,
    idle_of,
    idle_scopes,
    plan_scopes,
    with_evaluation,
)
from memplan.core.floor import peak_floor
from memplan.core.plan import Plan, make_plan
from memplan.core.planners import PLANNERS
from memplan.core.planners.common import ALL_CUTS
from memplan.errors import BudgetTooSmall

ROOM = 0.01  # unused fraction of a budget worth planning again for (``_raised``)
RETRIES = 4  # plans made again under a tightened budget before the least-peak plan is tried
GRAPH_PLANNERS = ("ilp",)  # given the Graph: they choose their own cut points
COMPARED = ("optimal", "ilp", "recursive", "drop-cheap", "sqrt")  # named in a refusal

Planner = Callable[[int | None], Plan]  # budget -> plan, or BudgetTooSmall


def evaluable(graph: g.Graph) -> bool:
    """Whether the graph records when each backward node ran (captures since schema 3): the
    evaluator needs it to place replays."""
    return not graph.backward_ops or any(op.unpack_event >= 0 for op in graph.ops)


def fit(graph: g.Graph, planner: str, budget_bytes: int | None, params: dict[str, Any],
        chain: C.Chain | None = None) -> Plan:
    """``planner``'s plan for ``graph`` whose evaluated peak fits ``budget_bytes`` (None: its
    least-peak plan), with ``peak_bytes`` the evaluated peak. Raises BudgetTooSmall, naming
    each planner's least evaluated peak, when none fits."""
    chain = C.build_chain(graph) if chain is None else chain
    runs = candidates(graph, chain, planner, params)
    if not evaluable(graph):
        return runs[0](budget_bytes)  # an old graph: the chain model's prediction alone
    if budget_bytes is None:
        return _floored(graph, least(graph, runs))
    notes: list[str] = []
    target = budget_bytes
    for _ in range(RETRIES + 1):
        found = [_evaluated(graph, p) for p in _accepting(runs, target)]
        fitting = [p for p in found if p.peak_bytes <= budget_bytes]
        if fitting:
            best = _raised(graph, runs, budget_bytes, target, min(fitting, key=_cost), notes)
            return _floored(graph, _noted(best, budget_bytes, notes))
        if not found:
            break
        over = min(p.peak_bytes for p in found) - budget_bytes
        notes.append(f"a plan for {format_bytes(target)} evaluated to "
                     f"{format_bytes(budget_bytes + over)}, over the budget: planned again")
        target -= over
        if target <= 0:
            break
    low = least(graph, runs)
    if low.peak_bytes <= budget_bytes:
        return _floored(graph, _noted(low, budget_bytes,
                                      notes + ["the least-peak plan is returned"]))
    raise refusal(graph, chain, budget_bytes, planner, low.peak_bytes, params)


def _raised(graph: g.Graph, runs: list[Planner], budget_bytes: int, target: int, best: Plan,
            notes: list[str]) -> Plan:
    """The chain model over-counts some steps (it adds stage peaks as if they coincided), so a
    plan can evaluate well below the budget it was made for. While that room is over
    ``ROOM`` of the budget, plan again at a target raised by it (halved when the plan made
    there does not fit), keeping the cheapest plan whose evaluated peak fits: the budget's
    bytes buy less recomputation. At most RETRIES more plans; deterministic."""
    step = budget_bytes - best.peak_bytes
    for _ in range(RETRIES):
        if step <= budget_bytes * ROOM:
            break
        plans = [_evaluated(graph, p) for p in _accepting(runs, target + step)]
        found = [p for p in plans if p.peak_bytes <= budget_bytes]
        if not found:
            step //= 2
            continue
        target += step
        cand = min(found, key=_cost)
        if _cost(cand) < _cost(best):
            notes.append(f"planned again for {format_bytes(target)}: the plan for less "
                         f"evaluated to {format_bytes(best.peak_bytes)}, room left in the "
                         "budget (the chain model over-counts this step)")
            best = cand
        step = budget_bytes - cand.peak_bytes
    return best


def candidates(graph: g.Graph, chain: C.Chain, planner: str, params: dict[str, Any]
               ) -> list[Planner]:
    """The plans ``planner`` makes for a budget. The dynamic program plans on the clean chain
    and, when the graph has more cut points (a layer's input held across its sub-layer
    boundaries makes them unclean) but at most ``max_stages``, also on the chain through all
    of them, whose model counts such values twice: the evaluation judges between them."""
    fn = PLANNERS[planner]
    if planner in GRAPH_PLANNERS:
        return [lambda budget: fn(graph, budget, **params)]
    chains = [chain]
    n_cuts = len(graph.cut_points)
    if (planner == "optimal" and "stage_time_s" not in params and chain.n < n_cuts <= int(params.get("max_stages") or ALL_CUTS)):
        chains.append(C.build_chain(graph, list(range(n_cuts))))
    return [_on(fn, c, params) for c in chains]


def _on(fn: Callable[..., Plan], chain: C.Chain, params: dict[str, Any]) -> Planner:
    return lambda budget: fn(chain, budget, **params)


def least(graph: g.Graph, runs: list[Planner]) -> Plan:
    """The candidate with the least evaluated peak (then the least recomputation)."""
    return min((_evaluated(graph, run(None)) for run in runs),
               key=lambda p: (p.peak_bytes, _cost(p)))


def least_peaks(graph: g.Graph, chain: C.Chain, params: dict[str, Any], skip: str = ""
                ) -> dict[str, int]:
    """The least evaluated peak of each planner in COMPARED (``skip``: already known)."""
    return {name: least(graph, candidates(graph, chain, name, _shared_params(name, params)))
            .peak_bytes for name in COMPARED if name != skip}


def refusal(graph: g.Graph, chain: C.Chain, budget_bytes: int, planner: str,
            least_bytes: int, params: dict[str, Any]) -> BudgetTooSmall:
    """BudgetTooSmall naming the least peak of ``planner`` and of the other planners."""
    peaks = least_peaks(graph, chain, params, skip=planner)
    peaks[planner] = least_bytes
    return budget_too_small(budget_bytes, least_bytes, planner, least_peaks=peaks,
                            floor=peak_floor(graph))


def _accepting(runs: list[Planner], budget: int) -> list[Plan]:
    """The candidates' plans for ``budget``, leaving out those that refuse it."""
    out = []
    for run in runs:
        try:
            out.append(run(budget))
        except BudgetTooSmall:
            continue
    return out


def _shared_params(planner: str, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters another planner takes from the user's: drop_cheap, and ilp's limits."""
    keys = {"optimal": ("drop_cheap",),
            "ilp": ("drop_cheap", "node_limit", "time_limit_s")}.get(planner, ())
    return {k: params[k] for k in keys if k in params}


def _cost(p: Plan) -> float:
    return float(p.extra_flops if p.predicted_time_s is None else p.predicted_time_s)


def _pruned(graph: g.Graph, plan: Plan, idle_ranges: list[tuple[int, int]] | None = None
            ) -> Plan:
    """The plan with the recompute scopes the runtime would never replay kept plainly
    (``evaluate.idle_scopes``, or ``idle_ranges`` when known): its mirror counts and extra
    FLOPs then say what runs."""
    idle = set(idle_scopes(graph, plan) if idle_ranges is None else idle_ranges)
    if not idle or plan.predicted_time_s is not None:  # (a measured-time plan stays whole)
        return plan

    def walk(items: tuple[S.Item, ...]) -> tuple[S.Item, ...]:
        out: list[S.Item] = []
        for it in items:
            if isinstance(it, S.DropCheap) and (it.stage, it.stage) in idle:
                out.append(S.Keep(it.stage))
            elif isinstance(it, S.Region) and (it.start, it.end) in idle:
                out.extend(S.Keep(k) for k in range(it.start, it.end + 1))
            elif isinstance(it, S.Region):
                out.append(S.Region(it.start, it.end, walk(it.body)))
            else:
                out.append(it)
        return tuple(out)

    cut_of = {c.after: i for i, c in enumerate(graph.cut_points)}
    chain = C.build_chain(graph, [cut_of[st.last_op] for st in plan.stages])
    note = f"{len(idle)} recompute scope(s) that nothing inside saves for backward kept plainly"
    return make_plan(chain, walk(plan.schedule), plan.planner, plan.params, plan.budget_bytes,
                     (*plan.notes, note))


def _evaluated(graph: g.Graph, plan: Plan) -> Plan:
    """The plan without idle scopes, its evaluated peak as ``peak_bytes`` (the chain model's
    in a note)."""
    scopes = plan_scopes(graph, plan)
    pruned = _pruned(graph, plan, idle_of(scopes, plan))
    # The scopes found for the idle ones are the pruned plan's when it kept them all.
    ev = evaluate_scopes(scopes) if pruned is plan else evaluate(graph, pruned)
    plan = pruned
    notes = plan.notes
    if ev.peak_bytes != plan.peak_bytes:
        note = (f"peak {ev.peak_bytes:,} B as the runtime runs it (the chain model "
                f"estimated {plan.peak_bytes:,} B), at {ev.peak_at}")
        notes += (note,)
    plain = graph.peak_bytes or plan.plain_peak_bytes
    return dataclasses.replace(with_evaluation(plan, ev), plain_peak_bytes=plain, notes=notes)


def _floored(graph: g.Graph, plan: Plan) -> Plan:
    """The plan with a note of the floor (``memplan.core.floor``): how far it is from the
    least peak any plan of this step could have."""
    floor = peak_floor(graph)
    note = (f"floor {format_bytes(floor.floor_bytes)} ({floor.floor_bytes:,} B): no plan of "
            f"this step goes below it (at {floor.where}); this plan's peak is "
            f"{plan.peak_bytes / max(floor.floor_bytes, 1):.2f}x of it")
    return dataclasses.replace(plan, notes=plan.notes + (note,))


def _noted(plan: Plan, budget_bytes: int, notes: list[str]) -> Plan:
    return dataclasses.replace(plan, budget_bytes=budget_bytes, notes=plan.notes + tuple(notes))
