"""Runs one training step (forward, loss, backward) of a workload or a user model under a
``StepTracer``, on fake tensors or real ones. Shared by capture and measure."""

from __future__ import annotations

import contextlib
import gc
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException
from torch.utils._pytree import tree_flatten

from memplan.core import graph as g
from memplan.core.plan_schema import MAX_SPEC_DEPTH
from memplan.errors import CaptureError, ConfigError, MemplanError, bad_arg
from memplan.models import Workload
from memplan.tracing.datadep import NoRealForward, Oracle, run_with_oracle
from memplan.tracing.fake import (
    fake_args,
    fake_call,
    fake_kwargs,
    fake_mode,
    fake_state,
    kept_python_state,
    make_fake_in_place,
    real_forward,
)
from memplan.tracing.meta_constants import META_NOTE, on_meta
from memplan.tracing.module_hooks import module_hooks
from memplan.tracing.opcache import FakeOpCache
from memplan.tracing.shims import TRACE_PATH_NOTE, trace_path
from memplan.tracing.stamp import Stamper
from memplan.tracing.tracer import StepTracer

LossFn = Callable[[Any], torch.Tensor]


@dataclass
class Target:
    """What to run: a model, its inputs and its loss, not yet materialised."""

    name: str
    build: Callable[[], tuple[nn.Module, tuple[Any, ...]]]
    loss_fn: LossFn
    user_model: nn.Module | None  # set when the user passed a real model
    workload: Workload | None = None  # set when it is a Workload
    kwargs: dict[str, Any] = field(default_factory=dict)  # the model's keyword inputs


def as_target(obj: Any, inputs: tuple[Any, ...], loss_fn: LossFn | None,
              kwargs: Mapping[str, Any] | None = None) -> Target:
    """Accept a Workload, or a model with example inputs (positional ``inputs``, keyword
    ``kwargs``) and a loss function."""
    kw = check_kwargs(kwargs)
    if isinstance(obj, Workload):
        if inputs or kw or loss_fn is not None:
            raise bad_arg(
                "inputs/kwargs/loss_fn", "nothing beside a Workload (it brings its own)",
                f"{len(inputs)} inputs, {len(kw)} keyword inputs, loss_fn={loss_fn!r}",
                "Pass either a Workload alone or model, *inputs, loss_fn=...",
            )
        w = obj
        return Target(w.spec, lambda: (w.build_model(), w.build_inputs()), w.loss, None, w)
    if isinstance(obj, nn.Module):
        if not inputs and not kw:
            raise bad_arg(
                "inputs", "at least one example input after the model (or kwargs=)", "none",
                "Call e.g. memplan.capture(model, x, loss_fn=lambda out: out.sum()), or pass "
                "inputs by keyword: memplan.capture(model, kwargs={'input_ids': ids}, ...).",
            )
        model = obj
        return Target(type(model).__name__, lambda: (model, inputs), loss_fn or default_loss,
                      model, kwargs=kw)
    raise bad_arg(
        "model", "a memplan Workload or a torch.nn.Module", type(obj).__name__,
        "Use memplan.models.get(...) or pass your nn.Module.",
    )


def check_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A model's keyword inputs as a dict (None: none), or a clear error."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise bad_arg("kwargs", "a dict of the model's keyword inputs", type(kwargs).__name__,
                      "Write e.g. kwargs={'attention_mask': mask}, or kwargs=batch for "
                      "model(**batch).")
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise bad_arg("kwargs", "a dict with string keys (the forward's parameter names)",
                      repr(bad[0]), "Use the names of the forward's parameters as keys.")
    return dict(kwargs)


def refuse_stray(fn: Callable[..., Any], stray: Mapping[str, Any]) -> None:
    """A keyword ``fn`` (a memplan entry point) does not take (``memplan.capture(model,
    **batch)``), as an error that names it and, where it holds a tensor, points to
    ``kwargs=``; otherwise it lists what ``fn`` takes, read off its signature."""
    if not stray:
        return
    where = f"memplan.{fn.__name__}"
    name, value = next(iter(stray.items()))
    if isinstance(value, torch.Tensor):
        raise bad_arg(name, f"an argument of {where} (the model's keyword inputs go in "
                      "kwargs=)", f"a tensor of shape {list(value.shape)}",
                      f"Pass them as {where}(model, kwargs={{{name!r}: ..., ...}}) (a whole "
                      f"batch: kwargs=batch).")
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes = [f"{p.name}=" for p in list(inspect.signature(fn).parameters.values())[1:]
             if p.kind in named]
    shown = value if value is None or isinstance(value, (bool, int, float, str)) \
        else type(value).__name__
    raise bad_arg(name, f"an argument of {where}", shown,
                  f"{where} takes {', '.join(takes[:-1])} and {takes[-1]}; a model's keyword "
                  "inputs go in kwargs=.")


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
    kwarg_specs: dict[str, dict[str, Any]]
    notes: tuple[str, ...] = ()  # assumptions the step was captured under (``datadep``)
    answers: dict[str, list[dict[str, Any]]] | None = None  # ``Oracle.answers``
    trace_path: bool = False  # captured on the libraries' trace path (``shims``)


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
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
def _fake_mode(simulate: bool, model: nn.Module | None) -> Iterator[FakeTensorMode | None]:
    if not simulate:
        yield None
        return
    with fake_mode(model is not None and on_meta(model)) as mode:
        yield mode


def run_step(target: Target, *, simulate: bool, record: bool, device: str | None = None,
             fast: bool = True, stamp: bool = False) -> StepResult:
    """One forward+loss+backward under a tracer. Fake tensors when ``simulate``; ops whose
    output depends on tensor data are then sized from one real forward (``datadep``).
    ``fast=False`` runs every op through the fake mode itself and builds a Workload on fake
    tensors (the reference the fast path is tested against: the same Graph). A recorded fake
    step hands autograd proxies of what it saves (``StepTracer.pack``), so each value's
    death in the user's code is seen too (``Value.death_unsaved``). ``stamp`` (a recorded
    fast fake step): repeated module calls stamped from their first (``stamp``)."""
    if not simulate:
        return _run_step(target, None, record, device, fast)

    def real() -> None:
        model, inputs = _materialise(target, device)
        real_forward(model, inputs, target.loss_fn, kwargs=target.kwargs)

    def attempt(oracle: Oracle) -> StepResult:
        return _run_step(target, oracle, record, device, fast, stamp)

    oracle = Oracle()
    try:
        try:
            result: StepResult = run_with_oracle(attempt, real, oracle)
        except NoRealForward:
            oracle = Oracle()
            with trace_path():  # where libraries read no data (``shims``), or the same error
                result = run_with_oracle(attempt, real, oracle)
            result.trace_path, result.notes = True, result.notes + (TRACE_PATH_NOTE,)
        if target.user_model is not None and on_meta(target.user_model):
            result.notes += (META_NOTE,)
        result.answers = oracle.answers()
        return result
    except MemplanError:
        raise
    except UnsupportedOperatorException as err:
        raise CaptureError(
            f"capture: {target.name} runs {err.func}, which has no fake-tensor kernel (memplan "
            "captures the step on fake tensors, without memory). Register one with "
            "torch.library.register_fake, or file an issue with the model."
        ) from err
    except Exception as err:
        raise CaptureError(
            f"capture: the training step of {target.name} raised {type(err).__name__} on fake "
            f"tensors: {err}. Check that it runs plainly (model(*inputs, **kwargs), loss_fn(output), "
            "backward) on these inputs; if it does, file an issue with the model."
            + _packed(target, err)
        ) from err


def _packed(target: Target, err: Exception) -> str:
    """A hint where the inputs came packed: ``capture(model, (x, edge_index))`` gives the
    forward one tuple (the public functions take a model's inputs as separate arguments),
    ``capture(model, batch)`` one dict where the model takes ``model(**batch)``."""
    if target.user_model is None or target.kwargs:
        return ""
    inputs = target.build()[1]  # a user model's: the objects passed, nothing built
    if len(inputs) == 1 and type(inputs[0]) is dict and all(isinstance(k, str)
                                                            for k in inputs[0]):
        return (f" The one input given is a dict of {len(inputs[0])}: if the model takes "
                "them by keyword (model(**batch)), pass kwargs=batch instead.")
    if not isinstance(err, TypeError) or len(inputs) != 1 or not isinstance(inputs[0],
                                                                              (tuple, list)):
        return ""
    return (f" The one input given is a {type(inputs[0]).__name__} of {len(inputs[0])}: pass "
            "the model's inputs as separate arguments, memplan.capture(model, *inputs, "
            "loss_fn=...).")


@dataclass
class _Step:
    """What a step runs: the model (for its module paths), its parameters, buffers and inputs
    as the step sees them (fake copies under a fake mode), and what to call."""

    model: nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    call: Callable[..., Any]


def _run_step(target: Target, oracle: Oracle | None, record: bool, device: str | None,
              fast: bool, stamp: bool = False) -> StepResult:
    simulate = oracle is not None
    meta_model = None
    if simulate and fast and target.workload is not None:
        # Built on the meta device, outside the fake mode (init kernels in C++ rather than
        # one by one through the fake mode: most of a ResNet-1000's capture otherwise), and
        # made fake in _prepare.
        with no_cyclic_gc(), torch.device("meta"):
            meta_model = target.workload.build_model()
    kept = target.user_model if simulate else None  # its Python attributes: restored after
    with (kept_python_state(kept) if kept is not None else contextlib.nullcontext()), \
            no_cyclic_gc(), _fake_mode(simulate, kept) as fake:
        step = _prepare(target, fake, meta_model, device, fast)
        cache = FakeOpCache(fake) if fake is not None and fast else None
        tracer = StepTracer(record=record, fake=fake, oracle=oracle, cache=cache)
        for p in step.params.values():
            tracer.register(p, g.PARAMETER)
            if p.grad is not None:
                tracer.register(p.grad, g.GRADIENT)
        for b in step.buffers.values():
            tracer.register(b, g.BUFFER)
        for x in _tensors((step.inputs, step.kwargs)):
            tracer.register(x, g.INPUT)
        saves: Any = contextlib.nullcontext()
        if record and fake is not None:  # saves apart from their values: tracer.pack
            saves = torch.autograd.graph.saved_tensors_hooks(tracer.pack, tracer.unpack)
        stamper = Stamper(tracer, step.model) if stamp and record and cache is not None else None
        with module_hooks(tracer, step.model) if record else contextlib.nullcontext(), tracer:
            with saves, stamper.installed() if stamper else contextlib.nullcontext():
                tracer.in_model = True
                out = step.call(*step.inputs, **step.kwargs)
                tracer.in_model = False
                tracer.model_ops = len(tracer.ops)
                loss = target.loss_fn(out)
            _check_loss(loss)
            tracer.end_forward()
            if stamper is not None:
                stamper.end_forward()
            output_ids = tuple(
                i for i in (tracer._lookup(t) for t in _tensors((out, loss))) if i is not None
            )
            loss.backward()  # type: ignore[no-untyped-call]
        if stamper is not None:
            stamper.finish()
        param_list = list(step.params.values())
        for p in param_list:
            if p.grad is not None:
                vid = tracer._lookup(p.grad)
                if vid is not None and tracer.values[vid].kind == g.BACKWARD:
                    tracer.values[vid].kind = g.GRADIENT
        del out, loss
        tracer.close()
        notes = oracle.notes() if oracle is not None else ()
        return StepResult(tracer, param_list, output_ids, input_specs(step.inputs),
                          kwarg_specs(step.kwargs), notes)


def _prepare(target: Target, fake: FakeTensorMode | None, meta_model: nn.Module | None,
             device: str | None, fast: bool) -> _Step:
    if fake is not None and meta_model is not None and target.workload is not None:
        on = torch.device(device or "cpu")
        with torch.device(on):
            inputs = target.workload.build_inputs()
        params, buffers = make_fake_in_place(fake, meta_model, on)
        return _Step(meta_model, params, buffers, inputs, {}, meta_model)
    model, inputs = _materialise(target, device)
    if fake is None:
        return _Step(model, dict(model.named_parameters()), dict(model.named_buffers()),
                     inputs, target.kwargs, model)
    params, buffers = fake_state(fake, model, fast)  # fake copies of the model and inputs
    return _Step(model, params, buffers, fake_args(fake, inputs),
                 fake_kwargs(fake, target.kwargs), fake_call(model, params, buffers))


def _materialise(target: Target, device: str | None) -> tuple[nn.Module, tuple[Any, ...]]:
    if device is not None and target.user_model is None:
        with torch.device(device):
            return target.build()
    return target.build()


def input_specs(inputs: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Plain-data description of example inputs (shapes, dtypes; simple values as they are;
    lists, tuples and string-keyed dicts of those), enough to rebuild fake inputs and check a
    plan against a model (``memplan.apply``)."""
    return [_spec(x, MAX_SPEC_DEPTH) for x in inputs]


def kwarg_specs(kwargs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``input_specs`` of keyword inputs, by name."""
    return {name: _spec(x, MAX_SPEC_DEPTH) for name, x in kwargs.items()}


def _spec(x: Any, depth: int) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
                "requires_grad": bool(x.requires_grad)}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"value": x}
    if depth > 0 and type(x) in (list, tuple):
        return {type(x).__name__: [_spec(v, depth - 1) for v in x]}
    if depth > 0 and type(x) is dict and all(isinstance(k, str) for k in x):
        return {"dict": {k: _spec(v, depth - 1) for k, v in x.items()}}
    return {"type": type(x).__name__}


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
