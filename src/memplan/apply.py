"""``memplan.apply``: train an unmodified model under a plan; ``memplan.unapply`` undoes it.

The model object itself is patched (its ``forward``), so the user's loop, optimizer,
``state_dict`` keys and wrappers (DDP) stay as they were. What apply adds to the model is plain
data and module-level callables: ``copy.deepcopy`` gives a copy that runs under the same plan
on its own weights, and ``torch.save(model)`` pickles it. A plan is checked against the model
before anything changes: the model's forward is run once on fake tensors (no memory, its
Python attributes restored afterwards) and its op sequence must match the one the plan was
made for; inputs of other shapes than the plan's are warned about with the predicted peak.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memplan import graph as g
from memplan import runtime as R
from memplan import units as U
from memplan.errors import MemplanError, bad_arg
from memplan.plan import Plan
from memplan.report import format_bytes

_ATTR = "_memplan_applied"


@dataclass
class Applied:
    """What apply() did to a model, kept on it so that unapply() can undo it. Copies and
    pickles keep the plan; the runtime fields start afresh."""

    plan: Plan
    layout: R.Layout
    hooks: list[Any]
    had_forward: bool
    old_forward: Any
    weight_bytes: int  # parameters and buffers: what does not grow with the batch
    state: R.StepState | None = None
    last: R.StepState | None = None  # the latest planned forward (tests read its counters)
    warned: bool = False
    warned_inputs: set[tuple[Any, ...]] = field(default_factory=set)
    wrappers_checked: bool = False  # FSDP units inside the model: checked at the first step
    infos: dict[str, R.UnitInfo] = field(default_factory=dict)  # per unit module

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
    applied = _record(self)
    original = _original(self, applied)
    if not (self.training and torch.is_grad_enabled()):
        return original(*args, **kwargs)
    return _run_planned(self, applied, original, args, kwargs)


PlannedForward.__func__ = staticmethod(planned_forward)


def _record(model: nn.Module) -> Applied:
    applied: Applied | None = model.__dict__.get(_ATTR)
    if applied is None:
        raise MemplanError("memplan: this model's planned forward has no plan (was "
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
def _run_planned(model: nn.Module, applied: Applied, original: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
    lay = applied.layout
    if not applied.wrappers_checked:  # fully_shard may come after apply: check here
        if lay.templates:
            from memplan.distributed import check_wrappers

            check_wrappers(model)
        applied.wrappers_checked = True
    _check_inputs(applied, args)

    def info(path: str, module: nn.Module) -> R.UnitInfo:
        got = applied.infos.get(path)
        if got is None:
            got = applied.infos[path] = R.unit_info(module, path)
        return got

    names = {id(a): f"input {i} of the model's forward" for i, a in enumerate(args)
             if isinstance(a, torch.Tensor)}
    names.update({id(v): f"input '{k}' of the model's forward" for k, v in kwargs.items()
                  if isinstance(v, torch.Tensor)})
    state = R.StepState(lay, info, R.Namer(model, names))
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
        if state is not None and not R.replaying():
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
        if state is None or R.replaying():
            return
        if self.unit:
            state.on_unit_end(self.path, out)
        if self.boundary:
            state.on_call_end(self.path)


def apply(model: nn.Module, plan: Plan | str | dict[str, Any] | None = None, *,
          budget: object = None, inputs: tuple[Any, ...] | None = None, loss_fn: Any = None,
          planner: str = "optimal", objective: str = "flops") -> nn.Module:
    """Make ``model`` train under ``plan`` (a Plan, its JSON file, or its dict), or plan and
    apply in one call: ``apply(model, budget="6GiB", inputs=(x,), loss_fn=...)``.

    Returns the same module. ``eval()`` or ``torch.no_grad()`` forwards run plainly.
    Raises MemplanError (and leaves the model untouched) when the plan was made for another
    model; warns, with the predicted peak, when ``inputs`` have other shapes than the plan's.
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
    fake = _check(model, plan, inputs)
    lay = R.layout(plan, int(forward["ops"]), fake.call_ends, fake.calls, fake.values)
    weights = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
               for t in list(model.parameters()) + list(model.buffers())}
    applied = Applied(plan, lay, [], "forward" in model.__dict__, model.__dict__.get("forward"),
                      sum(weights.values()))
    if inputs is not None:
        _check_inputs(applied, inputs, stacklevel=3)
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


# --- inputs ------------------------------------------------------------------------------------


def _spec_text(spec: tuple[Any, ...]) -> str:
    return ", ".join("-" if s is None else f"{list(s[0])} {str(s[1]).removeprefix('torch.')}"
                     for s in spec)


def _input_spec(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in args)


def _plan_spec(plan: Plan) -> tuple[Any, ...]:
    specs = (plan.forward or {}).get("inputs", [])
    return tuple((tuple(s["shape"]), getattr(torch, s["dtype"])) if "shape" in s else None
                 for s in specs)


def _check_inputs(applied: Applied, args: tuple[Any, ...], stacklevel: int = 4) -> None:
    """Warn, once per input shape, when a forward's tensor inputs differ from the plan's:
    the plan's stages still hold, its memory does not (predicted peak scaled by the inputs'
    size: activations grow with the batch, weights do not)."""
    want = _plan_spec(applied.plan)[: len(args)]  # inputs passed by keyword: not compared
    got = _input_spec(args[: len(want)])
    if got == want or got in applied.warned_inputs or len(applied.warned_inputs) > 16:
        return
    applied.warned_inputs.add(got)
    ratio = 1.0
    for w, h in zip(want, got):
        if w is not None and h is not None:
            old = _numel(w[0]) * w[1].itemsize
            ratio = max(ratio, _numel(h[0]) * h[1].itemsize / old if old else 1.0)
    plan = applied.plan
    fixed = min(applied.weight_bytes, plan.peak_bytes)
    scaled = int(fixed + (plan.peak_bytes - fixed) * ratio)
    over = ""
    if plan.budget_bytes is not None and scaled > plan.budget_bytes:
        over = f", over its budget of {format_bytes(plan.budget_bytes)}"
    warnings.warn(
        f"memplan: the plan was made for inputs {_spec_text(want)}; this forward's are "
        f"{_spec_text(got)}. Gradients stay exact, but its predicted peak of "
        f"{format_bytes(plan.peak_bytes)} becomes about {format_bytes(scaled)} (scaled by "
        f"the inputs' size){over}. Make a plan for these inputs: memplan.plan(model, *inputs, "
        "loss_fn=..., budget=...), then memplan.unapply(model) and memplan.apply(model, plan).",
        stacklevel=stacklevel)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# --- the plan against the model: a forward on fake tensors ------------------------------------


@dataclass
class FakeForward:
    """One training-mode forward of a model on fake tensors."""

    targets: list[str]  # its ops, counted as capture counts them
    call_ends: dict[str, list[int]]  # for watched modules: op count at the end of each call
    calls: list[U.Call]  # its module calls (units are chosen among them)
    values: U.Values  # lifetimes of the values it makes


def _check(model: nn.Module, plan: Plan, inputs: tuple[Any, ...] | None) -> FakeForward:
    """Run the forward on fake tensors and compare its op sequence with the plan's."""
    forward = plan.forward or {}
    watch = sorted({st.module for st in plan.stages if _has_module(model, st.module)})
    want_ops, want_fp = int(forward["ops"]), str(forward["fingerprint"])
    mismatch = (f"apply: the plan was made for another model or other inputs (its forward has "
                f"{want_ops} ops, fingerprint {want_fp}")
    fix = ("The model was left untouched; make a plan for it with memplan.plan(model, *inputs, "
           "loss_fn=..., budget=...).")
    try:
        fake = forward_targets(model, inputs, forward.get("inputs", []),
                               forward.get("autocast"), watch)
    except MemplanError:
        raise
    except Exception as err:  # the user's forward failed on the plan's inputs
        first = (str(err).strip().splitlines() or [""])[0][:300]
        shown = _spec_text(_plan_spec(plan)) if inputs is None else _spec_text(_input_spec(inputs))
        raise MemplanError(f"{mismatch}; this model's forward fails on inputs {shown}: "
                           f"{type(err).__name__}: {first}). {fix}") from err
    got_fp = g.forward_fingerprint(fake.targets)
    if len(fake.targets) != want_ops or got_fp != want_fp:
        raise MemplanError(f"{mismatch}; this model's has {len(fake.targets)} ops, fingerprint "
                           f"{got_fp}). {fix}")
    return fake


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


_NORM_STATS = ("running_mean", "running_var", "num_batches_tracked")


def forward_targets(model: nn.Module, inputs: tuple[Any, ...] | None,
                    specs: list[dict[str, Any]] | None = None,
                    autocast: dict[str, str] | None = None, watch: list[str] | None = None,
                    ) -> FakeForward:
    """The op sequence and module calls of one training-mode forward on fake tensors
    (counted as capture counts), from real example inputs or from input specs; the model's
    parameters, buffers, Python attributes and the RNG are left as they were."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    from memplan.step import _no_cyclic_gc, functional_state, kept_python_state

    names = {id(m): path for path, m in model.named_modules()}
    counter = _Count()
    call_ends: dict[str, list[int]] = {path: [] for path in watch or []}
    open_calls: list[tuple[str, int, int]] = []
    numbers: dict[str, int] = {}
    calls: list[tuple[str, int, int, int]] = []

    def pre(mod: nn.Module, args: Any) -> None:
        path = names.get(id(mod))
        if path is not None:
            numbers[path] = numbers.get(path, 0) + 1
            open_calls.append((path, numbers[path], len(counter.targets)))

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        path = names.get(id(mod))
        if path is None:
            return
        if path in call_ends:
            call_ends[path].append(len(counter.targets))
        while open_calls:
            p, n, start = open_calls.pop()
            if p == path:
                calls.append((p, n, start, len(counter.targets)))
                break

    rng = torch.get_rng_state()
    device = next(iter(model.parameters()), torch.empty(0)).device
    with contextlib.ExitStack() as stack:
        stack.enter_context(kept_python_state(model))
        stack.enter_context(_quiet_fake_tensor_log())  # a failing forward is reported by us
        stack.enter_context(_no_cyclic_gc())  # values die by reference counting, in order
        stack.callback(torch.set_rng_state, rng)
        stack.enter_context(_global_module_hooks(pre, post))
        fake = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
        by_name: dict[str, torch.Tensor] = {
            k: fake.from_tensor(v) for k, v in list(model.named_parameters())
            + list(model.named_buffers())}
        state = functional_state(model, by_name)
        counter.stats = {id(t) for k, t in by_name.items() if _is_norm_stat(model, k)}
        if inputs is None:
            args = _spec_inputs(specs or [], device)
        else:
            args = tuple(fake.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)
        if not model.training:  # the check runs a training forward (per-module flags kept)
            model.train()
        for kind, dtype in (autocast or {}).items():
            stack.enter_context(torch.autocast(kind, dtype=getattr(torch, dtype)))
        stack.enter_context(counter)
        stack.enter_context(torch.enable_grad())
        out = functional_call(model, state, args, tie_weights=False)
        counter.kept = set(counter.live.values())
        del out
    return FakeForward(counter.targets, call_ends, _calls(model, calls, counter),
                       counter.lifetimes())


def _is_norm_stat(model: nn.Module, name: str) -> bool:
    path, _, attr = name.rpartition(".")
    return attr in _NORM_STATS and isinstance(model.get_submodule(path),
                                              nn.modules.batchnorm._NormBase)


def _calls(model: nn.Module, calls: list[tuple[str, int, int, int]], count: _Count
           ) -> list[U.Call]:
    """Module calls of the fake forward; safe when none of its ops writes a tensor made
    before the call (BatchNorm statistics excepted). Calls of the root and of modules with
    their own instance forward are never units."""
    out = []
    for path, number, start, end in calls:
        if not path or "forward" in model.get_submodule(path).__dict__:
            continue
        safe = all(count.outside[i] >= start for i in range(start, end))
        out.append(U.Call(path, number, start, end, safe))
    return out


class _Count(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the forward's ops as capture does. For each op, the earliest op that made a
    tensor it writes (parameters, buffers, inputs: -1; BatchNorm statistics ignored); for
    each storage an op makes, when it was made, last read and freed (in op counts)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.targets: list[str] = []
        self.outside: list[int] = []
        self.values: list[list[int]] = []  # [made, last read, freed (-1: alive), bytes]
        self.live: dict[int, int] = {}  # storage -> value
        self.kept: set[int] = set()  # values alive when the forward returned
        self.stats: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from memplan.tracer import is_counted

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not is_counted(func):
            return out
        index = len(self.targets)
        self.targets.append(str(func))
        for t in R._tensors((args, kwargs)):
            vid = self.live.get(t.untyped_storage()._cdata)
            if vid is not None:
                self.values[vid][1] = index
        first = index
        for t, mode in R.written_tensors(func, args, kwargs):
            if id(t) in self.stats or mode == R.WRITE_ONLY:
                continue
            vid = self.live.get(t.untyped_storage()._cdata)
            first = min(first, -1 if vid is None else self.values[vid][0])
        self.outside.append(first)
        for o in R._tensors(out):
            storage = o.untyped_storage()
            key = storage._cdata
            if key not in self.live:
                self.live[key] = len(self.values)
                weakref.finalize(storage, self._died, key, len(self.values))
                self.values.append([index, index, -1, int(storage.nbytes())])
        return out

    def lifetimes(self) -> U.Values:
        made, read, freed, nbytes = ([v[i] for v in self.values] for i in range(4))
        return U.Values(made, read, [-1 if i in self.kept else f for i, f in enumerate(freed)],
                        nbytes)

    def _died(self, key: int, vid: int) -> None:
        self.values[vid][2] = len(self.targets)
        if self.live.get(key) == vid:
            del self.live[key]

@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _global_module_hooks(pre: Any, post: Any) -> Iterator[None]:
    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()
