"""Runs one training step (forward, loss, backward) of a workload or a user model under a
``StepTracer``, on fake tensors or real ones. Shared by capture and measure."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from memplan import graph as g
from memplan.errors import MemplanError, bad_arg
from memplan.models import Workload
from memplan.tracer import StepTracer, module_hooks

LossFn = Callable[[Any], torch.Tensor]


@dataclass
class Target:
    """What to run: a model, its inputs and its loss, not yet materialised."""

    name: str
    build: Callable[[], tuple[nn.Module, tuple[Any, ...]]]
    loss_fn: LossFn
    user_model: nn.Module | None  # set when the user passed a real model


def as_target(obj: Any, inputs: tuple[Any, ...], loss_fn: LossFn | None) -> Target:
    """Accept a Workload, or a model with example inputs and a loss function."""
    if isinstance(obj, Workload):
        if inputs or loss_fn is not None:
            raise bad_arg(
                "inputs/loss_fn", "nothing beside a Workload (it brings its own)",
                f"{len(inputs)} inputs, loss_fn={loss_fn!r}",
                "Pass either a Workload alone or model, *inputs, loss_fn=...",
            )
        w = obj
        return Target(w.spec, lambda: (w.build_model(), w.build_inputs()), w.loss, None)
    if isinstance(obj, nn.Module):
        if not inputs:
            raise bad_arg(
                "inputs", "at least one example input after the model", "none",
                "Call e.g. memplan.capture(model, x, loss_fn=lambda out: out.sum()).",
            )
        model = obj
        return Target(type(model).__name__, lambda: (model, inputs), loss_fn or _default_loss, model)
    raise bad_arg(
        "model", "a memplan Workload or a torch.nn.Module", type(obj).__name__,
        "Use memplan.models.get(...) or pass your nn.Module.",
    )


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().mean() if out.dim() else out
    raise MemplanError(
        f"loss_fn: the model returned {type(out).__name__}, not a tensor, and no loss_fn was "
        "given. Pass loss_fn=... that maps the model's output to a scalar loss."
    )


@dataclass
class StepResult:
    tracer: StepTracer
    params: list[torch.Tensor]
    output_ids: tuple[int, ...]
    input_specs: list[dict[str, Any]]


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Storages die by reference counting; the cyclic collector only adds time (its full passes
    over a 100k-node autograd graph made LSTM T=2048 superlinear) and nondeterminism."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _fake_mode(simulate: bool) -> Iterator[FakeTensorMode | None]:
    if not simulate:
        yield None
        return
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


@contextlib.contextmanager
def kept_python_state(model: nn.Module) -> Iterator[None]:
    """Restore the attributes of ``model``'s modules that a forward rebinds (call counters,
    cached shapes, a fake tensor kept as an attribute): forwards on fake tensors (capture,
    plan, apply's check) leave the model as they found it. Changes inside mutable attributes
    (a list a forward appends to) are not undone."""
    saved = [(m, dict(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for m, before in saved:
            now = m.__dict__
            for key in [k for k in now if k not in before]:
                del now[key]
            for key, value in before.items():
                if now.get(key, _MISSING) is not value:
                    now[key] = value


_MISSING = object()


def run_step(target: Target, *, simulate: bool, record: bool, device: str | None = None) -> StepResult:
    """One forward+loss+backward under a tracer. Fake tensors when ``simulate`` (a user's
    model keeps its Python attributes: ``kept_python_state``)."""
    kept = simulate and target.user_model is not None
    with (kept_python_state(target.user_model) if kept and target.user_model is not None
          else contextlib.nullcontext()), _no_cyclic_gc(), _fake_mode(simulate) as fake:
        model, inputs = _materialise(target, fake, device)
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        if fake is not None and target.user_model is not None:
            params = {k: _fake_param(fake, v) for k, v in params.items()}
            buffers = {k: fake.from_tensor(v) for k, v in buffers.items()}
            inputs = tuple(fake.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)
        call = _caller(model, params, buffers, fake is not None and target.user_model is not None)
        tracer = StepTracer(record=record)
        for p in params.values():
            tracer.register(p, g.PARAMETER)
            if p.grad is not None:
                tracer.register(p.grad, g.GRADIENT)
        for b in buffers.values():
            tracer.register(b, g.BUFFER)
        for x in _tensors(inputs):
            tracer.register(x, g.INPUT)
        with module_hooks(tracer, model) if record else contextlib.nullcontext(), tracer:
            tracer.in_model = True
            out = call(*inputs)
            tracer.in_model = False
            tracer.model_ops = len(tracer.ops)
            loss = target.loss_fn(out)
            _check_loss(loss)
            tracer.end_forward()
            output_ids = tuple(
                i for i in (tracer._lookup(t) for t in _tensors((out, loss))) if i is not None
            )
            loss.backward()  # type: ignore[no-untyped-call]
        param_list = list(params.values())
        for p in param_list:
            if p.grad is not None:
                vid = tracer._lookup(p.grad)
                if vid is not None and tracer.values[vid].kind == g.BACKWARD:
                    tracer.values[vid].kind = g.GRADIENT
        del out, loss
        tracer.close()
        return StepResult(tracer, param_list, output_ids, input_specs(inputs))


def _materialise(
    target: Target, fake: FakeTensorMode | None, device: str | None
) -> tuple[nn.Module, tuple[Any, ...]]:
    if device is not None and target.user_model is None:
        with torch.device(device):
            return target.build()
    return target.build()


def _fake_param(fake: FakeTensorMode, p: torch.Tensor) -> torch.Tensor:
    t = fake.from_tensor(p)  # a fake leaf that keeps requires_grad
    t.grad = None  # a step starts from zeroed (None) grads, as after optimizer.zero_grad()
    return t


def _caller(
    model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], functional: bool
) -> Callable[..., Any]:
    if not functional:
        return model
    state = functional_state(model, {**params, **buffers})
    return lambda *args: functional_call(model, state, args, tie_weights=False)


def functional_state(model: nn.Module, by_name: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``by_name`` (keyed as ``named_parameters()``/``named_buffers()`` name them) spread over
    every distinct (module, attribute) that holds one of those tensors, once each. Tied
    weights (two modules, one parameter) get the same replacement; a submodule reached under
    two paths is swapped once (functional_call swapping it twice restores it wrongly)."""
    originals = dict(model.named_parameters()) | dict(model.named_buffers())
    by_id = {id(t): by_name[name] for name, t in originals.items() if name in by_name}
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, str]] = set()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        path, _, attr = name.rpartition(".")
        key = (id(model.get_submodule(path)), attr)
        if key not in seen and id(t) in by_id:
            seen.add(key)
            out[name] = by_id[id(t)]
    return out


def input_specs(inputs: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Plain-data description of example inputs (shapes, dtypes; simple values as they are),
    enough to rebuild fake inputs and check a plan against a model (``memplan.apply``)."""
    specs: list[dict[str, Any]] = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            specs.append({"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
                          "requires_grad": bool(x.requires_grad)})
        elif x is None or isinstance(x, (bool, int, float, str)):
            specs.append({"value": x})
        else:
            specs.append({"type": type(x).__name__})
    return specs


def _tensors(tree: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise MemplanError(
            "loss_fn: expected a scalar tensor that requires grad, got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}. "
            "Return e.g. criterion(output, target) from loss_fn."
        )
