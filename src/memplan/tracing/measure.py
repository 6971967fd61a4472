"""``memplan.measure``: peak memory and step time of one training step, real or simulated."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from memplan.core import graph as g
from memplan.core.report import MemoryReport
from memplan.errors import bad_arg
from memplan.tracing.device import check_device
from memplan.tracing.step import LossFn, StepResult, Target, as_target, refuse_stray, run_step
from memplan.tracing.timing import step_times


def measure(
    model: Any,
    *inputs: Any,
    kwargs: Mapping[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    simulate: bool = True,
    device: str = "cpu",
    repeat: int = 3,
    **stray: Any,
) -> MemoryReport:
    """Peak bytes of one forward+loss+backward step.

    ``simulate=True`` runs the step on fake tensors (no memory is allocated, any size works).
    ``simulate=False`` runs it for real on ``device`` with the same live-storage tracker, adds
    the CUDA allocator's peak on CUDA, and times ``repeat`` further untracked steps (median).
    A Workload is built on ``device``; a user model and inputs are used where they are.
    ``kwargs``: inputs the forward takes by keyword (``model(*inputs, **kwargs)``).
    """
    refuse_stray(measure, stray)
    if repeat < 1:
        raise bad_arg("repeat", "an integer >= 1", repeat, "Use repeat=3 (the default).")
    dev = check_device(device)
    target = as_target(model, inputs, loss_fn, kwargs)
    if simulate:
        result = run_step(target, simulate=True, record=False, device=device)
        return _report(target, result, device, simulated=True)
    allocator_peak = None
    with _grads_set_aside(target):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        result = run_step(target, simulate=False, record=False, device=device)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            allocator_peak = torch.cuda.max_memory_allocated(dev) - base
        step_time = _time_steps(target, device, repeat)
    report = _report(target, result, device, simulated=False)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    return MemoryReport(
        **{**report.to_dict(), "step_time_s": step_time, "allocator_peak_bytes": allocator_peak,
           "device_name": name}
    )


@contextlib.contextmanager
def _grads_set_aside(target: Target) -> Iterator[None]:
    """A measured step starts from None grads (as after ``optimizer.zero_grad()``); the user's
    own grads are put back afterwards."""
    if target.user_model is None:
        yield
        return
    params = list(target.user_model.parameters())
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, kept):
            p.grad = grad


def _report(target: Target, result: StepResult, device: str, simulated: bool) -> MemoryReport:
    tracer = result.tracer
    breakdown = {k: 0 for k in g.KINDS}
    at = tracer.peak_event
    for v in tracer.values:  # live at the peak event (pre-existing values have birth -1)
        if v.birth <= at and (v.death is None or v.death >= at):
            breakdown[v.kind] += v.nbytes
    return MemoryReport(
        name=target.name,
        device=device,
        simulated=simulated,
        peak_bytes=tracer.peak_bytes,
        forward_peak_bytes=tracer.forward_peak_bytes,
        breakdown_at_peak=breakdown,
        param_bytes=sum(v.nbytes for v in tracer.values if v.kind == g.PARAMETER),
    )


def _time_steps(target: Target, device: str, repeat: int) -> float:
    """Median seconds of ``repeat`` untracked steps (after one warm-up step)."""
    model, inputs = target.build() if target.user_model is not None else _build_on(target, device)
    return step_times([(model, inputs)], target.loss_fn, repeat, torch.device(device),
                      target.kwargs)[0]


def _build_on(target: Target, device: str) -> tuple[Any, tuple[Any, ...]]:
    with torch.device(device):
        return target.build()
