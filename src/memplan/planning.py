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


def plan(w_or_model: Any, *inputs: Any, loss_fn: Any = None, budget: object = None,
         planner: str = "optimal", objective: str = "flops",
         stage_time_s: list[float] | None = None, **params: Any) -> Plan:
    """Plan a training step under ``budget`` (bytes, '6GiB'/'7GB'/'512MiB', or a fraction of
    the plain peak such as 0.25). ``w_or_model``: a Workload, a model (with example inputs and
    ``loss_fn``), or an already captured Graph. ``objective='time'`` needs ``stage_time_s``
    (measured forward seconds per chain stage). Raises BudgetTooSmall when nothing fits."""
    if planner not in PLANNERS:
        raise bad_arg("planner", f"one of {sorted(PLANNERS)}", planner,
                      "Use planner='optimal' (the default).")
    if objective not in OBJECTIVES:
        raise bad_arg("objective", f"one of {list(OBJECTIVES)}", objective,
                      "Use objective='flops' (the default).")
    if objective == "time":
        if planner != "optimal":
            raise bad_arg("planner", "'optimal' when objective='time'", planner,
                          "Use planner='optimal' or objective='flops'.")
        if stage_time_s is None:
            raise MemplanError(
                "objective='time' needs measured stage times: pass stage_time_s=[forward seconds "
                "of each chain stage] (not measured automatically yet), or use objective='flops'."
            )
        params["stage_time_s"] = stage_time_s
    if isinstance(w_or_model, g.Graph):
        graph = w_or_model
    else:
        from memplan.capture import capture  # lazily: the planning core stays torch-free

        graph = capture(w_or_model, *inputs, loss_fn=loss_fn)
    chain = C.build_chain(graph)
    plain_peak = C.simulate(chain, C.plain_schedule(chain))[0]
    budget_bytes = None if budget is None else parse_budget(budget, plain_peak)
    result = PLANNERS[planner](chain, budget_bytes, **params)
    # Bind the plan to the model's forward, so that apply() can check a model against it.
    return dataclasses.replace(result, forward=graph.meta.get("forward"))
