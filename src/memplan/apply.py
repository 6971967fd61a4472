"""``memplan.apply``: train an unmodified model under a plan; ``memplan.unapply`` undoes it.

The model object itself is patched (its ``forward``), so the user's loop, optimizer,
``state_dict`` keys and wrappers (DDP) stay as they were. A plan is checked against the model
before anything changes: the model's forward is run once on fake tensors (no memory) and its
op sequence must match the one the plan was made for.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memplan import graph as g
from memplan import runtime as R
from memplan.errors import MemplanError, bad_arg
from memplan.plan import Plan

_ATTR = "_memplan_applied"


@dataclass
class Applied:
    """What apply() did to a model, kept on it so that unapply() can undo it."""

    plan: Plan
    layout: R.Layout
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
    Raises MemplanError (and leaves the model untouched) when the plan was made for another
    model or other inputs.
    """
    if not isinstance(model, nn.Module):
        raise bad_arg("model", "a torch.nn.Module", type(model).__name__,
                      "Pass the model you train.")
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise MemplanError(
            "apply: this model is a torch.compile wrapper; apply the plan to the model itself "
            "and compile afterwards: model = torch.compile(memplan.apply(model, plan))."
        )
    if getattr(model, _ATTR, None) is not None:
        raise MemplanError(
            "apply: this model already runs under a memplan plan; call memplan.unapply(model) "
            "first to change the plan."
        )
    if inputs is not None and not isinstance(inputs, tuple):
        raise bad_arg("inputs", "a tuple of example inputs", type(inputs).__name__,
                      "Write inputs=(x,) for a single input.")
    if plan is None:
        if budget is None or inputs is None:
            raise bad_arg("plan", "a Plan, or budget= with inputs= to make one", None,
                          "Call apply(model, plan) or apply(model, budget='6GiB', "
                          "inputs=(x,), loss_fn=...).")
        from memplan.planning import plan as make

        plan = make(model, *inputs, loss_fn=loss_fn, budget=budget, planner=planner,
                    objective=objective)
    elif budget is not None:
        raise bad_arg("budget", "nothing when a plan is given", budget,
                      "Give either a plan or a budget, not both.")
    plan = _as_plan(plan)
    forward = plan.forward
    if not forward:
        raise MemplanError(
            "apply: the plan does not record the model forward it was made for (it was made "
            "from a Chain, not by memplan.plan(...)); make it with memplan.plan(model, *inputs, "
            "loss_fn=..., budget=...)."
        )
    call_ends = _check(model, plan, inputs)
    lay = R.layout(plan, int(forward["ops"]), call_ends)
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
                from memplan.distributed import check_wrappers

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
                "the prediction. Make a plan for these inputs.", stacklevel=2,
            )
        return out

    for path in lay.boundary_modules:
        mod = model.get_submodule(path)
        applied.hooks.append(mod.register_forward_hook(_boundary_hook(applied, path)))
    if hasattr(original, "__func__"):  # keep the signature: HF Trainer & co. inspect it
        functools.update_wrapper(planned_forward, original.__func__)
    model.forward = types.MethodType(planned_forward, model)
    setattr(model, _ATTR, applied)
    return model


def unapply(model: nn.Module) -> nn.Module:
    """Undo ``apply``: the model's own forward again, hooks removed."""
    applied: Applied | None = getattr(model, _ATTR, None)
    if applied is None:
        raise MemplanError("unapply: this model is not running under a memplan plan.")
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


def _as_plan(plan: Plan | str | dict[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        try:
            with open(plan) as fh:
                return Plan.from_dict(json.load(fh))
        except OSError as err:
            raise bad_arg("plan", "a Plan or the path of a plan JSON file", str(plan),
                          f"Check the path ({err.strerror}).") from None
        except json.JSONDecodeError as err:
            raise bad_arg("plan", "a plan JSON file", str(plan),
                          f"The file is not JSON ({err.msg}); write it with plan.to_json().") from None
    raise bad_arg("plan", "a memplan Plan, a plan JSON path or dict", type(plan).__name__,
                  "Make one with memplan.plan(...).")


def _check(model: nn.Module, plan: Plan, inputs: tuple[Any, ...] | None
           ) -> dict[str, list[int]]:
    """Run the forward on fake tensors and compare its op sequence with the plan's; return
    where the calls of the plan's stage-ending modules end (op counts)."""
    forward = plan.forward or {}
    watch = sorted({st.module for st in plan.stages if _has_module(model, st.module)})
    targets, call_ends = forward_targets(model, inputs, forward.get("inputs", []),
                                         forward.get("autocast"), watch)
    want_ops, want_fp = int(forward["ops"]), str(forward["fingerprint"])
    got_fp = g.forward_fingerprint(targets)
    if len(targets) != want_ops or got_fp != want_fp:
        raise MemplanError(
            f"apply: the plan was made for another model or other inputs (its forward has "
            f"{want_ops} ops, fingerprint {want_fp}; this model's has {len(targets)} ops, "
            f"fingerprint {got_fp}). The model was left untouched; make a plan for it with "
            "memplan.plan(model, *inputs, loss_fn=..., budget=...)."
        )
    return call_ends


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False  # "<end>": the end of the step, not a module
    return True


def _spec_inputs(specs: list[dict[str, Any]], device: torch.device) -> tuple[Any, ...]:
    out: list[Any] = []
    for i, spec in enumerate(specs):
        if "shape" in spec:
            t = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
            out.append(t.requires_grad_(bool(spec.get("requires_grad"))))
        elif "value" in spec:
            out.append(spec["value"])
        else:
            raise MemplanError(
                f"apply: the plan's example input {i} is a {spec.get('type')}, which cannot be "
                "rebuilt to check the plan; pass inputs=(...) to memplan.apply."
            )
    return tuple(out)


def forward_targets(model: nn.Module, inputs: tuple[Any, ...] | None,
                    specs: list[dict[str, Any]] | None = None,
                    autocast: dict[str, str] | None = None, watch: list[str] | None = None,
                    ) -> tuple[list[str], dict[str, list[int]]]:
    """The op sequence of one training-mode forward on fake tensors (counted as capture
    counts), from real example inputs or from input specs; the model's parameters, buffers
    and the RNG are left untouched."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils._python_dispatch import TorchDispatchMode

    from memplan.step import functional_state
    from memplan.tracer import is_counted

    class Count(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.targets: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if is_counted(func):
                self.targets.append(str(func))
            return func(*args, **(kwargs or {}))

    was_training = model.training
    rng = torch.get_rng_state()
    counter = Count()
    call_ends: dict[str, list[int]] = {path: [] for path in watch or []}
    hooks = [model.get_submodule(path).register_forward_hook(
        lambda mod, a, o, path=path: call_ends[path].append(len(counter.targets)))
        for path in watch or []]
    device = next(iter(model.parameters()), torch.empty(0)).device
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as fake:
            state = functional_state(model, {k: fake.from_tensor(v) for k, v in list(
                model.named_parameters()) + list(model.named_buffers())})
            if inputs is None:
                args = _spec_inputs(specs or [], device)
            else:
                args = tuple(fake.from_tensor(x) if isinstance(x, torch.Tensor) else x
                             for x in inputs)
            model.train()
            with contextlib.ExitStack() as stack:
                for kind, dtype in (autocast or {}).items():
                    stack.enter_context(torch.autocast(kind, dtype=getattr(torch, dtype)))
                stack.enter_context(counter)
                stack.enter_context(torch.enable_grad())
                functional_call(model, state, args, tie_weights=False)
        return counter.targets, call_ends
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
        torch.set_rng_state(rng)
