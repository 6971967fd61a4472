"""The front doors: what turns "a Workload, or a model and its inputs, or a Graph" into a
Graph, and the calls that plan it: ``memplan.plan``, ``memplan.plan_memory`` and
``memplan.feature_map_bytes``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from memplan.core import chain as C
from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.budget import parse_budget
from memplan.core.fit import fit
from memplan.core.plan import Plan
from memplan.core.planners import PLANNERS
from memplan.core.planners.ilp import ilp_chain
from memplan.core.static import allocation
from memplan.core.static.allocation import Allocation, check_strategy
from memplan.errors import ConfigError, bad_arg
from memplan.models import Workload
from memplan.tracing.capture import capture
from memplan.tracing.step import LossFn
from memplan.tracing.timing import stage_times

OBJECTIVES = ("flops", "time")
TIME_PLANNERS = ("optimal", "ilp")  # the planners that minimise measured time


def as_graph(obj: Any, *inputs: Any, kwargs: Mapping[str, Any] | None = None,
             loss_fn: LossFn | None = None, device: str | None = None) -> g.Graph:
    """``obj`` itself when it is a Graph, else its captured step (``memplan.capture``)."""
    if isinstance(obj, g.Graph):
        if inputs or kwargs is not None or loss_fn is not None:
            raise bad_arg("inputs/kwargs/loss_fn", "nothing beside a captured Graph",
                          f"{len(inputs)} inputs, kwargs={kwargs!r}, loss_fn={loss_fn!r}",
                          "A Graph already holds its step: pass it alone.")
        return obj
    if not isinstance(obj, (Workload, nn.Module)):
        raise bad_arg("model", "a memplan Graph, a Workload (memplan.models.get(...)) or a "
                      "torch.nn.Module", type(obj).__name__,
                      "Pass memplan.capture(...), memplan.models.get(...) or your model.")
    return capture(obj, *inputs, kwargs=kwargs, loss_fn=loss_fn, device=device)


def plan(w_or_model: Any, *inputs: Any, kwargs: Mapping[str, Any] | None = None,
         loss_fn: Any = None, budget: object = None, planner: str = "optimal",
         objective: str = "flops", stage_time_s: list[float] | None = None,
         device: str | None = None, **params: Any) -> Plan:
    """Plan a training step under ``budget`` (bytes, '6GiB'/'7GB'/'512MiB', or a fraction of
    the plain peak such as 0.25). ``w_or_model``: a Workload, a model (with example inputs,
    ``kwargs`` for those it takes by keyword, and ``loss_fn``), or an already captured Graph.
    ``params``: the planner's own settings (e.g. ``max_stages``). ``objective='time'``
    minimises the step time predicted from forward seconds per chain stage: ``stage_time_s``
    when given, else measured on ``device`` (default CPU) by
    ``memplan.tracing.timing.stage_times`` (a Graph alone cannot be run: pass stage_time_s
    with it). The plan's ``peak_bytes`` is its peak as the runtime runs it
    (``memplan.core.evaluate``), never above the budget. Raises BudgetTooSmall when nothing
    fits, naming the least peak each planner reaches."""
    if planner not in PLANNERS:
        raise bad_arg("planner", f"one of {sorted(PLANNERS)}", planner,
                      "Use planner='optimal' (the default).")
    _check_params(planner, params)
    if objective not in OBJECTIVES:
        raise bad_arg("objective", f"one of {list(OBJECTIVES)}", objective,
                      "Use objective='flops' (the default).")
    if objective == "time":
        if planner not in TIME_PLANNERS:
            raise bad_arg("planner", f"one of {list(TIME_PLANNERS)} when objective='time'",
                          planner, "Use planner='optimal' or objective='flops'.")
        if stage_time_s is None and isinstance(w_or_model, g.Graph):
            raise ConfigError(
                "objective='time' measures each stage's forward time by running the model, and "
                "a captured Graph cannot be run: pass the Workload or the model and its inputs "
                "instead, or stage_time_s=[forward seconds of each chain stage] (see "
                "memplan.tracing.timing.stage_times), or use objective='flops'."
            )
    graph = as_graph(w_or_model, *inputs, kwargs=kwargs, loss_fn=loss_fn, device=device)
    chain = C.build_chain(graph)
    plain_peak = graph.peak_bytes or S.simulate(chain, S.plain_schedule(chain))[0]
    budget_bytes = None if budget is None else parse_budget(budget, plain_peak)
    if objective == "time":
        if stage_time_s is None:
            stage_time_s = stage_times(w_or_model, *inputs, kwargs=kwargs, loss_fn=loss_fn,
                                       graph=graph, device=device or "cpu",
                                       chain=_planner_chain(planner, graph, chain, params))
        params["stage_time_s"] = stage_time_s
    # Held to its peak as the runtime runs it (core.fit), re-planned or refused if over.
    result = fit(graph, planner, budget_bytes, params, chain)
    # Bind the plan to the model's forward, so that apply() can check a model against it, and
    # say what the capture assumed.
    assumed = graph.forward.assumptions if graph.forward else ()
    return dataclasses.replace(result, forward=graph.forward, notes=result.notes + assumed)


def _check_params(planner: str, params: dict[str, Any]) -> None:
    """Each of ``params`` a setting of ``planner`` (``stage_time_s`` is plan's own), before
    anything is captured."""
    names = list(inspect.signature(PLANNERS[planner]).parameters)[2:]  # after graph, budget
    accepted = [n for n in names if n != "stage_time_s"]
    takes = (f"Planner {planner!r} takes {', '.join(accepted)}." if accepted
             else f"Planner {planner!r} takes no settings.")
    for name, value in params.items():
        if name in accepted:
            continue
        if isinstance(value, (bool, int, float, str, type(None))):
            raise bad_arg(name, f"a setting of planner {planner!r}", value, takes)
        raise bad_arg(name, f"a setting of planner {planner!r} (a model's keyword inputs go in "
                      "kwargs=)", type(value).__name__,
                      f"Pass the model's keyword inputs as kwargs={{{name!r}: ...}} (a whole "
                      f"batch: kwargs=batch). {takes}")


def _planner_chain(planner: str, graph: g.Graph, chain: C.Chain, params: dict[str, Any]
                   ) -> C.Chain:
    """The chain whose stages ``planner`` takes times for."""
    if planner == "ilp":
        return ilp_chain(graph, params.get("cuts", "auto"), params.get("max_stages", 100))
    return chain


def plan_memory(w_or_graph: Any, strategy: str = "sharing",
                plan: str | Plan | Sequence[int] | None = None) -> Allocation:
    """The static allocation (paper Sec. 3, Fig. 2) of a Workload's or Graph's training step
    under a mirror plan: None (keep everything), 'drop-cheap', 'sqrt', a Plan of
    ``memplan.plan``, or m(v) per forward op."""
    check_strategy(strategy)  # before the capture
    return allocation.plan_memory(as_graph(w_or_graph), strategy, plan)


def feature_map_bytes(w_or_graph: Any, strategy: str = "sharing",
                      plan: str | Plan | Sequence[int] | None = None) -> int:
    """The paper's feature-map memory (Fig. 5a, 6a): bytes of all buffers of the static plan."""
    return plan_memory(w_or_graph, strategy, plan).total_bytes
