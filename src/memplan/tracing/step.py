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
from torch.utils._pytree import tree_flatten

from memplan.core import graph as g
from memplan.errors import ConfigError, bad_arg
from memplan.models import Workload
from memplan.tracing.fake import fake_args, fake_call, fake_state
from memplan.tracing.tracer import StepTracer, module_hooks

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
        return Target(type(model).__name__, lambda: (model, inputs), loss_fn or default_loss, model)
    raise bad_arg(
        "model", "a memplan Workload or a torch.nn.Module", type(obj).__name__,
        "Use memplan.models.get(...) or pass your nn.Module.",
    )


def default_loss(out: Any) -> torch.Tensor:
    """The loss when none is given: the mean of the model's (tensor) output."""
    if isinstance(out, torch.Tensor):
        return out.float().mean() if out.dim() else out
    raise ConfigError(
        f"loss_fn: the model returned {type(out).__name__}, not a tensor, and no loss_fn was "
        "given. Pass loss_fn=... that maps the model's output to a scalar loss."
    )


@dataclass
class StepResult:
    tracer: StepTracer
    params: list[torch.Tensor]
    output_ids: tuple[int, ...]
    input_specs: list[dict[str, Any]]
    alive_after_forward: frozenset[int] = frozenset()  # value ids (``save=False`` only)


def _dropped(t: torch.Tensor) -> None:
    return None


def _never_unpacked(obj: None) -> torch.Tensor:
    raise AssertionError("memplan: a forward run with save=False has no backward")


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


def run_step(target: Target, *, simulate: bool, record: bool, device: str | None = None,
             save: bool = True) -> StepResult:
    """One forward+loss+backward under a tracer. Fake tensors when ``simulate``. With
    ``save=False``: forward and loss only, with autograd keeping nothing it would save (a
    saved-tensor hook drops it), so each value dies when the user's code drops it."""
    with _no_cyclic_gc(), _fake_mode(simulate) as fake:
        model, inputs = _materialise(target, fake, device)
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        call: Callable[..., Any] = model
        if fake is not None and target.user_model is not None:  # fake copies of the user's
            params, buffers = fake_state(fake, model)
            inputs = fake_args(fake, inputs)
            call = fake_call(model, params, buffers)
        tracer = StepTracer(record=record)
        for p in params.values():
            tracer.register(p, g.PARAMETER)
            if p.grad is not None:
                tracer.register(p.grad, g.GRADIENT)
        for b in buffers.values():
            tracer.register(b, g.BUFFER)
        for x in _tensors(inputs):
            tracer.register(x, g.INPUT)
        drop = (contextlib.nullcontext() if save
                else torch.autograd.graph.saved_tensors_hooks(_dropped, _never_unpacked))
        alive: frozenset[int] = frozenset()
        with module_hooks(tracer, model) if record else contextlib.nullcontext(), tracer:
            with drop:
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
            if save:
                loss.backward()  # type: ignore[no-untyped-call]
            else:
                alive = frozenset(v.id for v in tracer.values if v.death is None)
        param_list = list(params.values())
        for p in param_list:
            if p.grad is not None:
                vid = tracer._lookup(p.grad)
                if vid is not None and tracer.values[vid].kind == g.BACKWARD:
                    tracer.values[vid].kind = g.GRADIENT
        del out, loss
        tracer.close()
        return StepResult(tracer, param_list, output_ids, input_specs(inputs), alive)


def _materialise(
    target: Target, fake: FakeTensorMode | None, device: str | None
) -> tuple[nn.Module, tuple[Any, ...]]:
    if device is not None and target.user_model is None:
        with torch.device(device):
            return target.build()
    return target.build()


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
    flat, _ = tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ConfigError(
            "loss_fn: expected a scalar tensor that requires grad, got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}. "
            "Return e.g. criterion(output, target) from loss_fn."
        )
