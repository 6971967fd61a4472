"""``memplan.plan(...)``: capture lazily, then plan under a budget."""

from __future__ import annotations

import dataclasses
from typing import Any

from memplan import chain as C
from memplan import graph as g
from memplan.budget import parse_budget
from memplan.errors import MemplanError, bad_arg
from memplan.plan import Plan
from memplan.planners import PLANNERS

OBJECTIVES = ("flops", "time")
TIME_PLANNERS = ("optimal", "ilp")  # the planners that minimise measured time
GRAPH_PLANNERS = ("ilp",)  # given the Graph: they choose their own cut points


def plan(w_or_model: Any, *inputs: Any, loss_fn: Any = None, budget: object = None,
         planner: str = "optimal", objective: str = "flops",
         stage_time_s: list[float] | None = None, device: str | None = None,
         **params: Any) -> Plan:
    """Plan a training step under ``budget`` (bytes, '6GiB'/'7GB'/'512MiB', or a fraction of
    the plain peak such as 0.25). ``w_or_model``: a Workload, a model (with example inputs and
    ``loss_fn``), or an already captured Graph. ``objective='time'`` minimises the step time
    predicted from forward seconds per chain stage: ``stage_time_s`` when given, else measured
    on ``device`` (default CPU) by ``memplan.timing.stage_times`` (a Graph alone cannot be
    run: pass stage_time_s with it). Raises BudgetTooSmall when nothing fits."""
    if planner not in PLANNERS:
        raise bad_arg("planner", f"one of {sorted(PLANNERS)}", planner,
                      "Use planner='optimal' (the default).")
    if objective not in OBJECTIVES:
        raise bad_arg("objective", f"one of {list(OBJECTIVES)}", objective,
                      "Use objective='flops' (the default).")
    if objective == "time":
        if planner not in TIME_PLANNERS:
            raise bad_arg("planner", f"one of {list(TIME_PLANNERS)} when objective='time'",
                          planner, "Use planner='optimal' or objective='flops'.")
        if stage_time_s is None and isinstance(w_or_model, g.Graph):
            raise MemplanError(
                "objective='time' measures each stage's forward time by running the model, and "
                "a captured Graph cannot be run: pass the Workload or the model and its inputs "
                "instead, or stage_time_s=[forward seconds of each chain stage] (see "
                "memplan.timing.stage_times), or use objective='flops'."
            )
    if isinstance(w_or_model, g.Graph):
        graph = w_or_model
    else:
        from memplan.capture import capture  # lazily: the planning core stays torch-free

        graph = capture(w_or_model, *inputs, loss_fn=loss_fn, device=device)
    chain = C.build_chain(graph)
    plain_peak = C.simulate(chain, C.plain_schedule(chain))[0]
    budget_bytes = None if budget is None else parse_budget(budget, plain_peak)
    if objective == "time":
        if stage_time_s is None:
            from memplan.timing import stage_times  # lazily: measurement imports torch

            stage_time_s = stage_times(w_or_model, *inputs, loss_fn=loss_fn, graph=graph,
                                       device=device or "cpu", chain=_planner_chain(
                                           planner, graph, chain, params))
        params["stage_time_s"] = stage_time_s
    given: g.Graph | C.Chain = graph if planner in GRAPH_PLANNERS else chain
    result = PLANNERS[planner](given, budget_bytes, **params)
    # Bind the plan to the model's forward, so that apply() can check a model against it.
    return dataclasses.replace(result, forward=graph.meta.get("forward"))


def _planner_chain(planner: str, graph: g.Graph, chain: C.Chain, params: dict[str, Any]
                   ) -> C.Chain:
    """The chain whose stages ``planner`` takes times for."""
    if planner == "ilp":
        from memplan.planners.ilp import ilp_chain

        return ilp_chain(graph, params.get("cuts", "auto"), params.get("max_stages", 100))
    return chain
