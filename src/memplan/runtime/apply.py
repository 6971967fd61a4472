"""``memplan.apply``: train an unmodified model under a plan; ``memplan.unapply`` undoes it.

The model object itself is patched (its ``forward``), so the user's loop, optimizer,
``state_dict`` keys and wrappers (DDP) stay as they were. What apply adds to the model is plain
data and module-level callables: ``copy.deepcopy`` gives a copy that runs under the same plan
on its own weights, and ``torch.save(model)`` pickles it. A plan is checked against the model
before anything changes: the model's forward is run once on fake tensors (no memory, its
attributes restored afterwards, ``probe``) and its op sequence must match the one the plan
was made for; inputs of other shapes than the plan's are warned about with the predicted peak.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memplan.api import plan as make_plan
from memplan.core import graph as g
from memplan.core.graph import ForwardSpec
from memplan.core.plan import Plan, load_plan
from memplan.errors import ConfigError, MemplanError, PlanMismatch, bad_arg
from memplan.runtime import record as R
from memplan.runtime.input_specs import Spec, input_spec, plan_spec, spec_text, warn_other_inputs
from memplan.runtime.layout import Layout, layout
from memplan.runtime.probe import FakeForward, probe
from memplan.runtime.replay import replaying
from memplan.runtime.tape import Namer, UnitInfo, unit_info
from memplan.runtime.wrappers import check_wrappers
from memplan.tracing.step import check_kwargs, refuse_stray

_ATTR = "_memplan_applied"


@dataclass
class Applied:
    """What apply() did to a model, kept on it so that unapply() can undo it. Copies and
    pickles keep the plan; the runtime fields start afresh."""

    plan: Plan
    layout: Layout
    hooks: list[Any]
    had_forward: bool
    old_forward: Any
    weight_bytes: int  # parameters and buffers: what does not grow with the batch
    state: R.StepState | None = None
    last: R.StepState | None = None  # the latest planned forward (tests read its counters)
    warned: bool = False
    warned_inputs: set[Spec] = field(default_factory=set)
    wrappers_checked: bool = False  # FSDP units inside the model: checked at the first step
    infos: dict[str, UnitInfo] = field(default_factory=dict)  # per unit module

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "state": None, "last": None, "infos": {}}


class PlannedForward:
    """``model.forward`` of an applied model. Holds only the model: a deep copy rebinds it
    to the copy, pickle stores it by reference. Looks like a bound method (``__func__``,
    ``__self__``, the original signature) for libraries that inspect or wrap it."""

    __func__: Any

    def __init__(self, model: nn.Module) -> None:
        self.__self__ = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return planned_forward(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(_original(self.__self__, _record(self.__self__)))


def planned_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of an applied model: planned in training with grad enabled, the model's
    own forward otherwise (nothing is saved: nothing to plan)."""
    if not (self.training and torch.is_grad_enabled()):
        return _original(self, _record(self))(*args, **kwargs)
    return _run_planned(self, args, kwargs)


PlannedForward.__func__ = staticmethod(planned_forward)


def _record(model: nn.Module) -> Applied:
    applied: Applied | None = model.__dict__.get(_ATTR)
    if applied is None:
        raise ConfigError("memplan: this model's planned forward has no plan (was "
                          f"{_ATTR} deleted?); call memplan.apply(model, plan) again.")
    return applied


def _original(model: nn.Module, applied: Applied) -> Any:
    if applied.had_forward:
        return applied.old_forward
    return type(model).forward.__get__(model)


# torch.compile keeps the plan: Dynamo skips the planned forward (module hooks, dispatch modes
# and saved-tensor hooks that re-partition as they go are not traceable) and runs it eagerly;
# what surrounds it (loss, optimizer) is compiled as usual. Inference is compiled normally.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def _run_planned(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # The original forward is looked up here, not passed in: Dynamo rebuilds a bound method
    # passed across this graph break as ``model.forward``, which is the planned forward.
    applied = _record(model)
    original = _original(model, applied)
    lay = applied.layout
    if not applied.wrappers_checked:  # fully_shard may come after apply: check here
        if lay.templates:
            check_wrappers(model)
        applied.wrappers_checked = True
    warn_other_inputs(applied.plan, applied.weight_bytes, applied.warned_inputs, args, kwargs)

    def info(path: str, module: nn.Module) -> UnitInfo:
        got = applied.infos.get(path)
        if got is None:
            got = applied.infos[path] = unit_info(module, path)
        return got

    names = {id(a): f"input {i} of the model's forward" for i, a in enumerate(args)
             if isinstance(a, torch.Tensor)}
    names.update({id(v): f"input '{k}' of the model's forward" for k, v in kwargs.items()
                  if isinstance(v, torch.Tensor)})
    state = R.StepState(lay, info, Namer(model, names))
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


class _PreHook:
    """A unit module's call starts (registered first: later pre-hooks run inside the unit)."""

    def __init__(self, applied: Applied, path: str) -> None:
        self.applied = applied
        self.path = path

    def __call__(self, mod: nn.Module, args: Any, kwargs: Any) -> None:
        state = self.applied.state
        if state is not None and not replaying():
            state.on_call_start(self.path, mod, args, kwargs)


class _PostHook:
    """A unit's or a stage-ending module's call returned."""

    def __init__(self, applied: Applied, path: str, unit: bool, boundary: bool) -> None:
        self.applied = applied
        self.path = path
        self.unit = unit
        self.boundary = boundary

    def __call__(self, mod: nn.Module, args: Any, out: Any) -> None:
        state = self.applied.state
        if state is None or replaying():
            return
        if self.unit:
            state.on_unit_end(self.path, out)
        if self.boundary:
            state.on_call_end(self.path)


def apply(model: nn.Module, plan: Plan | str | dict[str, Any] | None = None, *,
          budget: object = None, inputs: tuple[Any, ...] | None = None,
          kwargs: Mapping[str, Any] | None = None, loss_fn: Any = None,
          planner: str = "optimal", objective: str = "flops", **stray: Any) -> nn.Module:
    """Make ``model`` train under ``plan`` (a Plan, its JSON file, or its dict), or plan and
    apply in one call: ``apply(model, budget="6GiB", inputs=(x,), loss_fn=...)``.
    ``inputs`` and ``kwargs`` (inputs taken by keyword): the example inputs the plan is
    checked on; without them, zeros of the plan's input shapes.

    Returns the same module. ``eval()`` or ``torch.no_grad()`` forwards run plainly.
    Raises PlanMismatch (and leaves the model untouched) when the plan was made for another
    model; warns, with the predicted peak, when ``inputs`` have other shapes than the plan's.
    """
    refuse_stray(apply, stray)
    _check_model(model, inputs)
    kw = None if kwargs is None else check_kwargs(kwargs)
    if kw is not None and inputs is None:
        inputs = ()  # all by keyword
    if plan is None:
        if budget is None or inputs is None:
            raise bad_arg("plan", "a Plan, or budget= with inputs= to make one", None,
                          "Call apply(model, plan) or apply(model, budget='6GiB', "
                          "inputs=(x,), loss_fn=...).")
        plan = make_plan(model, *inputs, kwargs=kw, loss_fn=loss_fn, budget=budget,
                         planner=planner, objective=objective)
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
    fake = _check(model, plan, plan.forward, inputs, kw)
    lay = layout(plan, plan.forward.ops, fake.call_ends, fake.calls, fake.values,
                 fake.targets, fake.written)
    applied = _install(model, plan, lay)
    if inputs is not None:
        warn_other_inputs(plan, applied.weight_bytes, applied.warned_inputs, inputs, kw,
                          stacklevel=3)
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


def _install(model: nn.Module, plan: Plan, lay: Layout) -> Applied:
    """Patch ``model.forward`` to run under the plan, with hooks on the modules whose calls
    end stages or are units."""
    weights = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
               for t in list(model.parameters()) + list(model.buffers())}
    applied = Applied(plan, lay, [], "forward" in model.__dict__, model.__dict__.get("forward"),
                      sum(weights.values()))
    boundaries = set(lay.boundary_modules)
    for path in sorted(boundaries | set(lay.units)):
        mod = model.get_submodule(path)
        unit = path in lay.units
        if unit:
            applied.hooks.append(mod.register_forward_pre_hook(
                _PreHook(applied, path), with_kwargs=True, prepend=True))
        applied.hooks.append(mod.register_forward_hook(
            _PostHook(applied, path, unit, path in boundaries)))
    model.forward = PlannedForward(model)
    setattr(model, _ATTR, applied)
    return applied


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


def _as_plan(plan: Plan | str | os.PathLike[str] | dict[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise bad_arg("plan", "a memplan Plan, a plan JSON path or dict", type(plan).__name__,
                  "Make one with memplan.plan(...).")


# --- the plan against the model: a forward on fake tensors ------------------------------------


def _check(model: nn.Module, plan: Plan, forward: ForwardSpec, inputs: tuple[Any, ...] | None,
           kwargs: dict[str, Any] | None) -> FakeForward:
    """Run the forward on fake tensors and compare its op sequence with the plan's."""
    watch = sorted({st.module for st in plan.stages if _has_module(model, st.module)})
    mismatch = (f"apply: the plan was made for another model or other inputs (its forward has "
                f"{forward.ops} ops, fingerprint {forward.fingerprint}")
    fix = ("The model was left untouched; make a plan for it with memplan.plan(model, *inputs, "
           "loss_fn=..., budget=...).")
    try:
        fake = probe(model, inputs, kwargs, forward, watch)
    except MemplanError:  # a mismatch, or data-dependent ops it could not size
        raise
    except Exception as err:  # the user's forward failed on the plan's inputs
        first = (str(err).strip().splitlines() or [""])[0][:300]
        shown = spec_text(plan_spec(plan) if inputs is None else input_spec(inputs, kwargs))
        raise PlanMismatch(f"{mismatch}; this model's forward fails on inputs {shown}: "
                           f"{type(err).__name__}: {first}). {fix}") from err
    got_fp = g.forward_fingerprint(fake.targets)
    if len(fake.targets) != forward.ops or got_fp != forward.fingerprint:
        # Rebuilt inputs are zeros: a forward whose ops follow the data runs others on them.
        zeros = ("" if inputs is not None else
                 " With no inputs= given, apply ran the forward on zeros of the plan's input "
                 "shapes: if the model's ops depend on the data (a mixture of experts' "
                 "routing, a loop over the tokens each expert got), pass the example inputs "
                 "the plan was made with: memplan.apply(model, plan, inputs=(...)"
                 + (", kwargs={...})." if forward.kwargs else ")."))
        given = set(kwargs or {}) if inputs is not None else set(forward.kwargs)
        missing = [k for k in forward.kwargs if k not in given]
        if missing:  # inputs= given, the plan's keyword inputs left out
            zeros += (f" The plan was made with keyword inputs {missing} that were not given: "
                      "pass them with kwargs={...}.")
        raise PlanMismatch(f"{mismatch}; this model's has {len(fake.targets)} ops, fingerprint "
                           f"{got_fp}). {fix}{zeros}")
    return fake


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False  # "<end>": the end of the step, not a module
    return True
