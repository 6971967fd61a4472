"""Measured times: the median training step (``step_times``, interleaved over models so
that machine noise hits them alike), and the forward time per chain stage for
``objective='time'`` (per-stage times measured on the real device instead of FLOPs, Sec. 4.3's
time cost).

One real forward (model and loss) runs under a ``TorchDispatchMode`` that times every aten op
it counts the way capture does (``opinfo.is_counted``), with ``torch.cuda.synchronize`` around
each op on CUDA; op ``i`` is then forward op ``i`` of the captured Graph (checked: same count,
same targets), and a stage's time is the sum over its ops ``first[s] .. last[s]``. The first
run warms up; each stage's time is the median over ``repeat`` more. Buffers (BatchNorm's
running statistics) and the RNG state are restored afterwards: the model is left as it was.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.core import chain as C
from memplan.core import graph as g
from memplan.errors import CaptureError, bad_arg
from memplan.tracing.capture import capture
from memplan.tracing.device import check_device
from memplan.tracing.opinfo import is_counted
from memplan.tracing.step import LossFn, Target, as_target


class _OpTimer(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Wall time of every counted op, in dispatch order."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cuda = cuda
        self.times_s: list[float] = []
        self.targets: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if not is_counted(func):
            return func(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        self.times_s.append(time.perf_counter() - t0)
        self.targets.append(str(func))
        return out


def op_times(w_or_model: Any, *inputs: Any, kwargs: Mapping[str, Any] | None = None,
             loss_fn: LossFn | None = None, graph: g.Graph | None = None, device: str = "cpu",
             repeat: int = 3) -> list[list[float]]:
    """Seconds of each forward op of the step (model and loss), one list per timed run.
    ``graph``: the captured Graph the ops must match (captured here when None)."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise bad_arg("repeat", "an integer >= 1", repeat, "Use repeat=3 (the default).")
    dev = check_device(device)
    target = as_target(w_or_model, inputs, loss_fn, kwargs)
    if graph is None:
        graph = capture(w_or_model, *inputs, kwargs=kwargs, loss_fn=loss_fn)
    expected = [op.target for op in graph.ops]
    model, real_inputs = _build(target, device)
    runs: list[list[float]] = []
    with _state_kept(model, dev):
        for i in range(repeat + 1):  # the first run warms up (allocator, kernels, caches)
            timer = _OpTimer(dev.type == "cuda")
            with timer:
                loss = target.loss_fn(model(*real_inputs, **target.kwargs))
            del loss
            _check(timer.targets, expected)
            if i:
                runs.append(timer.times_s)
    return runs


def stage_times(w_or_model: Any, *inputs: Any, kwargs: Mapping[str, Any] | None = None,
                loss_fn: LossFn | None = None, graph: g.Graph | None = None,
                device: str = "cpu", repeat: int = 3, chain: C.Chain | None = None
                ) -> list[float]:
    """Forward seconds of each stage of ``chain`` (default: ``build_chain(graph)``, the chain
    ``optimal`` plans over), measured on ``device``: the median over ``repeat`` real forwards
    of the sum of the stage's op times. Pass them as ``stage_time_s`` to the planners."""
    if graph is None:
        graph = capture(w_or_model, *inputs, kwargs=kwargs, loss_fn=loss_fn)
    if chain is None:
        chain = C.build_chain(graph)
    elif chain.fingerprint != graph.fingerprint:
        raise bad_arg("chain", "a chain of the given graph", chain.fingerprint,
                      "Build it with memplan.chain.build_chain(graph).")
    runs = op_times(w_or_model, *inputs, kwargs=kwargs, loss_fn=loss_fn, graph=graph,
                    device=device, repeat=repeat)
    first, last = chain.first.tolist(), chain.last.tolist()
    per_run = [[sum(run[a : b + 1]) for a, b in zip(first, last)] for run in runs]
    return [statistics.median(col) for col in zip(*per_run)]


def _build(target: Target, device: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """A Workload is built on ``device``; a user's model and inputs are used where they are."""
    if target.user_model is not None:
        return target.build()
    with torch.device(device):
        return target.build()


@contextlib.contextmanager
def _state_kept(model: torch.nn.Module, dev: torch.device) -> Iterator[None]:
    """Restore buffers, grads and RNG state: timing must not change the user's model."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, grad in grads:
            p.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, dev)


def _check(seen: list[str], expected: list[str]) -> None:
    """The real forward must run the captured ops, in order, for the times to map to stages."""
    if seen == expected:
        return
    i = next((i for i, (a, b) in enumerate(zip(seen, expected)) if a != b),
             min(len(seen), len(expected)))
    raise CaptureError(
        f"timing: the real forward ran {len(seen)} ops but the captured graph has "
        f"{len(expected)}; they first differ at op {i} (real "
        f"{seen[i] if i < len(seen) else 'end'!r}, captured "
        f"{expected[i] if i < len(expected) else 'end'!r}). Capture the graph from the same "
        "model and inputs (data-dependent control flow changes the op sequence), or pass "
        "stage_time_s yourself."
    )


def step_times(runs: Sequence[tuple[Any, tuple[Any, ...]]], loss: Callable[[Any], Any],
               repeat: int, device: torch.device | str = "cpu",
               kwargs: Mapping[str, Any] | None = None) -> list[float]:
    """Median seconds of one training step (forward, ``loss``, backward) per (model, inputs),
    ``kwargs`` (keyword inputs) the same for each.
    Rounds go over all models in turn (the first round warms up), so load from other
    processes hits them alike; CUDA steps are timed with events. Each step starts from None
    grads (as after ``optimizer.zero_grad()``), and the grads are dropped after it."""
    cuda = torch.device(device).type == "cuda"
    times: list[list[float]] = [[] for _ in runs]
    for i in range(repeat + 1):
        for k, (model, inputs) in enumerate(runs):
            for p in model.parameters():
                p.grad = None
            seconds = (_cuda_step_s if cuda else _cpu_step_s)(model, inputs, loss,
                                                              dict(kwargs or {}))
            for p in model.parameters():
                p.grad = None
            if i:
                times[k].append(seconds)
    return [float(statistics.median(t)) for t in times]


def _cpu_step_s(model: Any, inputs: tuple[Any, ...], loss: Callable[[Any], Any],
                kwargs: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    loss(model(*inputs, **kwargs)).backward()
    return time.perf_counter() - t0


def _cuda_step_s(model: Any, inputs: tuple[Any, ...], loss: Callable[[Any], Any],
                 kwargs: dict[str, Any]) -> float:
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    loss(model(*inputs, **kwargs)).backward()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / 1e3
