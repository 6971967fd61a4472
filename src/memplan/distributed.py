"""memplan under ``torch.distributed``: DDP and FSDP2 (``fully_shard``), one plan per rank.

* DDP leaves the model's modules alone, so ``memplan.apply(model, plan)`` before
  ``DistributedDataParallel(model)`` just works. DDP adds its gradient buckets (as many bytes
  as the trainable parameters, allocated when the model is wrapped): ``plan_ddp`` plans for
  ``budget - bucket_bytes(model)``.
* FSDP2 gathers a unit's parameters in the unit's forward pre-hook and frees them (storage
  resized to 0) after its forward, then gathers them again just before the unit's backward.
  A recompute scope that holds another unit's call would record those collectives on its tape
  and replay ops on freed parameters. So memplan is applied *per FSDP unit*: every unit gets
  its own plan, applied before ``fully_shard(unit)``; FSDP's hooks then run outside the
  planned forward, and a unit's replay runs in that unit's backward, when its parameters are
  gathered (exact, tested). ``plan_units`` / ``apply_units`` do this. ``check_wrappers``
  refuses a plan applied around nested FSDP units (``memplan.apply`` calls it).

Per-rank memory (``RankBudget``): the single-process picture (memplan's simulated step of the
model with the unit plans applied, on fake tensors) with parameters and gradients counted as
sharded, ``(P + G) / world_size`` instead of ``P + G``, plus FSDP's transient buffers: the
root unit's unsharded parameters (FSDP keeps them from the root's forward to its backward)
and ``5 x`` the largest unit's parameter bytes (the unit being run, the next one prefetched,
the all-gather buffer, its unsharded gradients and the reduce-scatter input). That is an
upper bound; ``RankTracker`` measures the real per-rank peak.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from memplan.api import plan as make_plan
from memplan.core.budget import budget_too_small, parse_budget
from memplan.core.plan import Plan
from memplan.errors import BudgetTooSmall, ConfigError, bad_arg
from memplan.runtime.apply import apply, unapply
from memplan.tracing.capture import capture
from memplan.tracing.datadep import Answering, NoRealForward, Oracle, run_with_oracle
from memplan.tracing.fake import fake_forward, real_forward
from memplan.tracing.measure import measure
from memplan.tracing.shims import trace_path
from memplan.tracing.step import input_specs, kwarg_specs

FSDP_UNIT_COPIES = 5  # unit run + prefetched + all-gather buffer + unsharded grads + RS input


# --- budgets -----------------------------------------------------------------------------------


def trainable_bytes(modules: Sequence[nn.Module]) -> int:
    """Bytes of the distinct trainable parameters of ``modules``."""
    seen: dict[int, int] = {}
    for mod in modules:
        for p in mod.parameters():
            if p.requires_grad:
                seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def bucket_bytes(model: nn.Module) -> int:
    """DDP's gradient buckets: one slot per trainable parameter, alive from wrapping on."""
    return trainable_bytes([model])


def plan_ddp(model: nn.Module, *inputs: Any, kwargs: Mapping[str, Any] | None = None,
             loss_fn: Any = None, budget: object, planner: str = "optimal",
             **params: Any) -> Plan:
    """A plan for one DDP rank (the model before wrapping, the rank's local batch, ``kwargs``
    its keyword inputs): the rank's ``budget`` (bytes or '6GiB') less DDP's gradient buckets.
    Deterministic: equal shapes on every rank give the same plan (compare
    ``fingerprint(plan)`` across ranks). ``params``: the planner's settings."""
    total = parse_budget(budget)
    left = total - bucket_bytes(model)
    if left <= 0:
        raise budget_too_small(total, bucket_bytes(model), planner)
    return make_plan(model, *inputs, kwargs=kwargs, loss_fn=loss_fn, budget=left,
                     planner=planner, **params)


def fingerprint(plans: Plan | Sequence[Plan] | UnitPlans) -> str:
    """A short hash of plans' JSON: equal on all ranks when planning is deterministic."""
    if isinstance(plans, UnitPlans):
        items: Sequence[Plan] = [plans.plans[u] for u in plans.units if u in plans.plans]
        extra = repr(plans.units)
    else:
        items = [plans] if isinstance(plans, Plan) else plans
        extra = ""
    h = hashlib.sha256(extra.encode())
    for p in items:
        h.update(p.to_json().encode())
    return h.hexdigest()[:16]


@dataclass
class RankBudget:
    """One rank's predicted peak under FSDP2, from the single-process simulated step."""

    world_size: int
    single_peak_bytes: int  # simulated single-process step, unit plans applied
    params_at_peak_bytes: int
    grads_at_peak_bytes: int
    root_bytes: int  # the root unit's own parameters (kept unsharded from forward to backward)
    largest_unit_bytes: int

    @property
    def sharding_saves_bytes(self) -> int:
        full = self.params_at_peak_bytes + self.grads_at_peak_bytes
        return full - full // self.world_size

    @property
    def transient_bytes(self) -> int:
        return self.root_bytes + FSDP_UNIT_COPIES * self.largest_unit_bytes

    @property
    def peak_bytes(self) -> int:
        return self.single_peak_bytes - self.sharding_saves_bytes + self.transient_bytes


@dataclass
class UnitPlans:
    """A plan per FSDP unit (``None``: the unit runs plainly) and the rank's predicted peak."""

    units: tuple[str, ...]
    plans: dict[str, Plan]
    rank: RankBudget
    budget_bytes: int | None
    fraction: float | None  # the units' budget as a fraction of their plain peak

    @property
    def peak_bytes(self) -> int:
        return self.rank.peak_bytes


def _unit_loss(out: Any) -> torch.Tensor:
    flat, _ = tree_flatten(out)
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ConfigError("plan_units: a unit returned no floating-point tensor to plan for.")
    total = tensors[0].float().sum()
    for t in tensors[1:]:
        total = total + t.float().sum()
    return total


Example = tuple[tuple[Any, ...], dict[str, Any]]  # a call's positional and keyword inputs


def unit_inputs(model: nn.Module, units: Sequence[str], *inputs: Any,
                kwargs: Mapping[str, Any] | None = None) -> dict[str, Example]:
    """Example inputs, positional and keyword, of each unit's (first) call in one training
    forward of ``model`` (``kwargs``: its keyword inputs), run on fake tensors (no memory,
    parameters untouched), returned with zero tensors of the same shapes, dtypes and
    requires_grad (in tuples, lists and dicts too; other values as they were). A Hugging Face
    decoder layer gets its mask and rotary tables by keyword."""
    seen: dict[str, Example] = {}

    def zeros(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.zeros(a.shape, dtype=a.dtype).requires_grad_(a.requires_grad)
        return a

    def pre_hook(path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
            if path not in seen:
                seen[path] = tree_map(zeros, (tuple(args), dict(kw)))
        return hook

    for path in units:
        model.get_submodule(path)  # a wrong path fails here, by name
    hooks = [model.get_submodule(p).register_forward_pre_hook(pre_hook(p), with_kwargs=True)
             for p in units]

    def attempt(oracle: Oracle) -> None:  # data-dependent values from one real forward
        seen.clear()
        fake_forward(model, inputs, kwargs=kwargs, within=[Answering(oracle)])

    def real() -> None:
        real_forward(model, inputs, kwargs=kwargs)

    try:
        try:
            run_with_oracle(attempt, real)
        except NoRealForward:
            with trace_path():  # as capture does (``shims``)
                run_with_oracle(attempt, real)
    finally:
        for h in hooks:
            h.remove()
    missing = [p for p in units if p not in seen]
    if missing:
        raise ConfigError(f"plan_units: units {missing} were not called by the forward.")
    return seen


def _check_rebuildable(path: str, example: Example) -> None:
    """A unit's plan is checked on inputs rebuilt from its specs (``apply_units``): tensors,
    plain values and lists, tuples and dicts of those. An object passed along the units (a
    Hugging Face KV cache) is none of these, and changes as each unit runs: a capture of the
    unit alone would not see the call the model makes."""
    specs = {f"input {i}": s for i, s in enumerate(input_specs(example[0]))}
    specs.update(kwarg_specs(example[1]))
    for name, spec in specs.items():
        odd = _opaque(spec)
        if odd is not None:
            raise ConfigError(
                f"plan_units: unit '{path}' is called with {name} holding a {odd}, which "
                "memplan cannot rebuild to plan the unit alone. For Hugging Face models, "
                "train with use_cache=False (no KV cache: pass it in kwargs= or set "
                "model.config.use_cache = False); otherwise choose units whose inputs are "
                "tensors and plain values.")


def _opaque(spec: dict[str, Any]) -> str | None:
    """The type name of the first value in ``spec`` (``tracing.step.input_specs``) that is
    recorded by its type only; None: every value can be rebuilt."""
    if "type" in spec:
        return str(spec["type"])
    inner = spec.get("list") or spec.get("tuple") or list((spec.get("dict") or {}).values())
    return next((t for t in map(_opaque, inner) if t is not None), None)


FRACTIONS = (0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.2)


def plan_units(model: nn.Module, units: Sequence[str], *inputs: Any,
               kwargs: Mapping[str, Any] | None = None, loss_fn: Any = None,
               budget: object = None, world_size: int = 1, planner: str = "optimal"
               ) -> UnitPlans:
    """Plans for FSDP units of ``model`` (not yet sharded) that fit one rank's ``budget``.

    Each unit is captured on its example inputs (``unit_inputs``) and planned alone; all
    units get the same budget fraction of their plain peak, the largest fraction (least
    recomputation) whose predicted rank peak (``RankBudget``) fits ``budget`` (a unit that
    cannot reach a fraction gets its least-memory plan). Without a budget every unit gets
    ``planner``'s plan without a budget (for 'optimal': the least peak). Deterministic: every
    rank gets the same plans for the same shapes (check with ``fingerprint``).
    """
    if world_size < 1:
        raise bad_arg("world_size", "an integer >= 1", world_size, "Pass dist.get_world_size().")
    paths = _check_units(units)
    total = None if budget is None else parse_budget(budget)
    examples = unit_inputs(model, paths, *inputs, kwargs=kwargs)
    for p in paths:
        _check_rebuildable(p, examples[p])
    graphs = {p: capture(model.get_submodule(p), *examples[p][0], kwargs=examples[p][1],
                         loss_fn=_unit_loss) for p in paths}

    def predict(plans: dict[str, Plan]) -> RankBudget:
        return rank_budget(model, paths, plans, inputs, loss_fn, world_size, kwargs)

    def at(fraction: float | None) -> dict[str, Plan]:
        out: dict[str, Plan] = {}
        for p in paths:
            try:
                out[p] = make_plan(graphs[p], budget=fraction, planner=planner)
            except BudgetTooSmall:
                out[p] = make_plan(graphs[p], budget=None, planner="optimal")
        return out

    if total is None:
        plans = at(None)
        return UnitPlans(paths, plans, predict(plans), None, None)
    plain = predict({})
    if plain.peak_bytes <= total:
        return UnitPlans(paths, {}, plain, total, 1.0)
    for fraction in (*FRACTIONS, None):  # None: each unit's least-memory plan
        plans = at(fraction)
        rank = predict(plans)
        if rank.peak_bytes <= total:
            return UnitPlans(paths, plans, rank, total, fraction)
    raise budget_too_small(total, rank.peak_bytes, planner)


def _check_units(units: Sequence[str]) -> tuple[str, ...]:
    paths = tuple(units)
    if not paths or len(set(paths)) != len(paths):
        raise bad_arg("units", "distinct module paths of FSDP units", units,
                      "Pass e.g. [f'layers.{i}' for i in range(n)].")
    for a in paths:
        for b in paths:
            if a != b and b.startswith(a + "."):
                raise bad_arg("units", "units that do not contain one another", (a, b),
                              "FSDP units are planned one by one: pass disjoint modules.")
    return paths


def rank_budget(model: nn.Module, units: Sequence[str], plans: dict[str, Plan],
                inputs: tuple[Any, ...], loss_fn: Any, world_size: int,
                kwargs: Mapping[str, Any] | None = None) -> RankBudget:
    """One rank's predicted peak, FSDP units ``units``, ``plans`` applied to theirs
    (simulated step; ``kwargs``: the model's keyword inputs)."""
    for p, pl in plans.items():
        apply(model.get_submodule(p), pl)
    try:
        rep = measure(model, *inputs, kwargs=kwargs, loss_fn=loss_fn, simulate=True)
    finally:
        for p in plans:
            unapply(model.get_submodule(p))
    mods = [model.get_submodule(p) for p in units]
    root_bytes = trainable_bytes([model]) - trainable_bytes(mods)
    largest = max(trainable_bytes([m]) for m in mods)
    return RankBudget(world_size, rep.peak_bytes, rep.breakdown_at_peak["parameter"],
                      rep.breakdown_at_peak["gradient"], root_bytes, largest)


def apply_units(model: nn.Module, plans: UnitPlans) -> nn.Module:
    """Apply each unit's plan to its module (call before ``fully_shard``); returns ``model``."""
    for path in plans.units:
        if path in plans.plans:
            apply(model.get_submodule(path), plans.plans[path])
    return model


# --- measuring a rank --------------------------------------------------------------------------


class RankTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Peak bytes of the storages one process's ops touch, counting each storage at its size
    *now* (FSDP resizes parameter storages to 0 and back), DTensors by their local shard.
    O(live storages) per op: for tests and small models. ``track`` registers what exists
    before the step (parameters, gradients, optimizer state)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._storages: dict[int, weakref.ref[Any]] = {}
        self.peak_bytes = 0

    def track(self, *trees: Any) -> None:
        for tree in trees:
            flat, _ = tree_flatten(tree)
            for t in flat:
                if isinstance(t, torch.Tensor):
                    self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        local = getattr(t, "_local_tensor", None)  # DTensor: this rank's shard
        if isinstance(local, torch.Tensor):
            t = local
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # a wrapper without storage of its own
        key = storage._cdata
        ref = self._storages.get(key)
        if ref is None or ref() is None:
            self._storages[key] = weakref.ref(storage)

    def live_bytes(self) -> int:
        total = 0
        dead = []
        for key, ref in self._storages.items():
            s = ref()
            if s is None:
                dead.append(key)
            else:
                total += int(s.nbytes())
        for key in dead:
            del self._storages[key]
        return total

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        self.track(args, kwargs)
        out = func(*args, **kwargs)
        self.track(out)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out
