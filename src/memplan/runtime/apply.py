"""``memplan.apply``: train an unmodified model under a plan; ``memplan.unapply`` undoes it.

The model object itself is patched (its ``forward``), so the user's loop, optimizer,
``state_dict`` keys and wrappers (DDP) stay as they were. A plan is checked against the model
before anything changes: the model's forward is run once on fake tensors (no memory) and its
op sequence must match the one the plan was made for.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memplan.api import plan as make_plan
from memplan.core import graph as g
from memplan.core.graph import ForwardSpec
from memplan.core.plan import Plan, load_plan
from memplan.errors import ConfigError, PlanMismatch, bad_arg
from memplan.runtime import replay as R
from memplan.runtime.layout import Layout, layout
from memplan.runtime.wrappers import check_wrappers
from memplan.tracing.fake import forward_targets

_ATTR = "_memplan_applied"


@dataclass
class Applied:
    """What apply() did to a model, kept on it so that unapply() can undo it."""

    plan: Plan
    layout: Layout
    hooks: list[Any]
    had_forward: bool
    old_forward: Any
    state: R.StepState | None = None
    last: R.StepState | None = None  # the latest planned forward (tests read its counters)
    warned: bool = False
    wrappers_checked: bool = False  # FSDP units inside the model: checked at the first step


def apply(model: nn.Module, plan: Plan | str | dict[str, Any] | None = None, *,
          budget: object = None, inputs: tuple[Any, ...] | None = None, loss_fn: Any = None,
          planner: str = "optimal", objective: str = "flops") -> nn.Module:
    """Make ``model`` train under ``plan`` (a Plan, its JSON file, or its dict), or plan and
    apply in one call: ``apply(model, budget="6GiB", inputs=(x,), loss_fn=...)``.

    Returns the same module. ``eval()`` or ``torch.no_grad()`` forwards run plainly.
    Raises PlanMismatch (and leaves the model untouched) when the plan was made for another
    model or other inputs.
    """
    _check_model(model, inputs)
    if plan is None:
        if budget is None or inputs is None:
            raise bad_arg("plan", "a Plan, or budget= with inputs= to make one", None,
                          "Call apply(model, plan) or apply(model, budget='6GiB', "
                          "inputs=(x,), loss_fn=...).")
        plan = make_plan(model, *inputs, loss_fn=loss_fn, budget=budget, planner=planner,
                         objective=objective)
    elif budget is not None:
        raise bad_arg("budget", "nothing when a plan is given", budget,
                      "Give either a plan or a budget, not both.")
    plan = _as_plan(plan)
    if plan.forward is None:
        raise PlanMismatch(
            "apply: the plan does not record the model forward it was made for (it was made "
            "from a Chain, not by memplan.plan(...)); make it with memplan.plan(model, *inputs, "
            "loss_fn=..., budget=...)."
        )
    call_ends = _check(model, plan, plan.forward, inputs)
    _install(model, plan, layout(plan, plan.forward.ops, call_ends))
    return model


def _check_model(model: nn.Module, inputs: tuple[Any, ...] | None) -> None:
    if not isinstance(model, nn.Module):
        raise bad_arg("model", "a torch.nn.Module", type(model).__name__,
                      "Pass the model you train.")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise ConfigError(
            "apply: this model is a torch.compile wrapper; apply the plan to the model itself "
            "and compile afterwards: model = torch.compile(memplan.apply(model, plan))."
        )
    if getattr(model, _ATTR, None) is not None:
        raise ConfigError(
            "apply: this model already runs under a memplan plan; call memplan.unapply(model) "
            "first to change the plan."
        )
    if inputs is not None and not isinstance(inputs, tuple):
        raise bad_arg("inputs", "a tuple of example inputs", type(inputs).__name__,
                      "Write inputs=(x,) for a single input.")


def _install(model: nn.Module, plan: Plan, lay: Layout) -> None:
    """Patch ``model.forward`` to run under the plan, with hooks on its stage-ending modules."""
    applied = Applied(plan, lay, [], "forward" in model.__dict__, model.__dict__.get("forward"))
    protected = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    original = model.forward

    def planned_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)  # nothing is saved: nothing to plan
        return run_planned(*args, **kwargs)

    # torch.compile keeps the plan: Dynamo skips the planned forward (module hooks, dispatch
    # modes and saved-tensor hooks that re-partition as they go are not traceable) and runs
    # it eagerly; what surrounds it (loss, optimizer) is compiled as usual. Inference is
    # compiled normally.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def run_planned(*args: Any, **kwargs: Any) -> Any:
        if not applied.wrappers_checked:  # fully_shard may come after apply: check here
            if lay.templates:
                check_wrappers(model)
            applied.wrappers_checked = True
        state = R.StepState(lay, protected)
        applied.state = state
        try:
            with R.planned(state):
                out = original(*args, **kwargs)
        finally:
            applied.state = None
        applied.last = state
        if not state.finished and not applied.warned:
            applied.warned = True
            warnings.warn(
                f"memplan: this forward passed {state.stage} of the plan's "
                f"{len(lay.end_calls) - 1} stage boundaries (other inputs or control flow than "
                "the plan was made for?); gradients stay exact, but memory may differ from "
                "the prediction. Make a plan for these inputs.", stacklevel=3,
            )
        return out

    for path in lay.boundary_modules:
        mod = model.get_submodule(path)
        applied.hooks.append(mod.register_forward_hook(_boundary_hook(applied, path)))
    if hasattr(original, "__func__"):  # keep the signature: HF Trainer & co. inspect it
        functools.update_wrapper(planned_forward, original.__func__)
    model.forward = types.MethodType(planned_forward, model)
    setattr(model, _ATTR, applied)


def unapply(model: nn.Module) -> nn.Module:
    """Undo ``apply``: the model's own forward again, hooks removed."""
    applied: Applied | None = getattr(model, _ATTR, None)
    if applied is None:
        raise ConfigError("unapply: this model is not running under a memplan plan.")
    for h in applied.hooks:
        h.remove()
    if applied.had_forward:
        model.forward = applied.old_forward
    else:
        del model.forward
    delattr(model, _ATTR)
    return model


def applied_state(model: nn.Module) -> Applied | None:
    """The apply record of a model (None when it runs plainly)."""
    return getattr(model, _ATTR, None)


def _boundary_hook(applied: Applied, path: str) -> Any:
    def hook(mod: nn.Module, args: Any, out: Any) -> None:
        state = applied.state
        if state is not None:
            state.on_call_end(path)
    return hook


def _as_plan(plan: Plan | str | os.PathLike[str] | dict[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise bad_arg("plan", "a memplan Plan, a plan JSON path or dict", type(plan).__name__,
                  "Make one with memplan.plan(...).")


def _check(model: nn.Module, plan: Plan, forward: ForwardSpec, inputs: tuple[Any, ...] | None
           ) -> dict[str, list[int]]:
    """Run the forward on fake tensors and compare its op sequence with the plan's; return
    where the calls of the plan's stage-ending modules end (op counts)."""
    watch = sorted({st.module for st in plan.stages if _has_module(model, st.module)})
    targets, call_ends = forward_targets(model, inputs, forward.inputs, forward.autocast, watch)
    got_fp = g.forward_fingerprint(targets)
    if len(targets) != forward.ops or got_fp != forward.fingerprint:
        raise PlanMismatch(
            f"apply: the plan was made for another model or other inputs (its forward has "
            f"{forward.ops} ops, fingerprint {forward.fingerprint}; this model's has "
            f"{len(targets)} ops, fingerprint {got_fp}). The model was left untouched; make a "
            "plan for it with memplan.plan(model, *inputs, loss_fn=..., budget=...)."
        )
    return call_ends


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False  # "<end>": the end of the step, not a module
    return True
