"""``memplan.verify``: one real step plain and one under a plan, compared.

Gradients, BatchNorm state and the RNG state after the step must be bit-equal; the measured
peak must be within 2% of the plan's prediction and within its budget. Step times come from
interleaved runs (medians), so machine noise hits both sides alike.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memplan.core.budget import format_bytes
from memplan.core.plan import Plan
from memplan.errors import bad_arg
from memplan.models import Workload
from memplan.runtime.apply import apply
from memplan.tracing.measure import measure
from memplan.tracing.step import check_kwargs, default_loss, refuse_stray
from memplan.tracing.timing import step_times

PEAK_TOLERANCE = 0.02  # predicted vs measured peak


@dataclass
class VerifyReport:
    grads_equal: bool
    max_abs_grad_diff: float
    buffers_equal: bool
    rng_equal: bool
    predicted_peak_bytes: int
    measured_peak_bytes: int  # the tracker's (all tensors' storages), under the plan
    plain_peak_bytes: int
    budget_bytes: int | None
    allocator_peak_bytes: int | None  # CUDA only
    plain_step_s: float
    planned_step_s: float
    device: str

    @property
    def peak_error(self) -> float:
        return self.measured_peak_bytes / max(self.predicted_peak_bytes, 1) - 1

    @property
    def step_time_ratio(self) -> float:
        return self.planned_step_s / self.plain_step_s if self.plain_step_s else float("nan")

    @property
    def peak_ok(self) -> bool:
        fits = self.budget_bytes is None or self.measured_peak_bytes <= self.budget_bytes
        return abs(self.peak_error) <= PEAK_TOLERANCE and fits

    @property
    def ok(self) -> bool:
        return self.grads_equal and self.buffers_equal and self.rng_equal and self.peak_ok

    def summary(self) -> str:
        def mark(good: bool) -> str:
            return "ok" if good else "FAILED"

        lines = [
            f"gradients        {mark(self.grads_equal)}: "
            + ("bit-equal to plain PyTorch" if self.grads_equal
               else f"differ (max |diff| {self.max_abs_grad_diff:.3g})"),
            f"BatchNorm state  {mark(self.buffers_equal)}: running stats and counters "
            + ("equal" if self.buffers_equal else "differ"),
            f"RNG state        {mark(self.rng_equal)}: "
            + ("equal after the step" if self.rng_equal else "differs after the step"),
            f"peak             {mark(self.peak_ok)}: measured {format_bytes(self.measured_peak_bytes)}"
            f" vs predicted {format_bytes(self.predicted_peak_bytes)} ({self.peak_error:+.2%}); "
            f"plain {format_bytes(self.plain_peak_bytes)}"
            + (f"; budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else ""),
        ]
        if self.allocator_peak_bytes is not None:
            lines.append(f"CUDA allocator   peak {format_bytes(self.allocator_peak_bytes)}")
        lines.append(f"step time        {self.planned_step_s * 1e3:.1f} ms vs plain "
                     f"{self.plain_step_s * 1e3:.1f} ms ({self.step_time_ratio:.2f}x) on "
                     f"{self.device}")
        lines.append("verdict          " + ("all hold" if self.ok else "FAILED"))
        return "\n".join(lines)


def verify(w_or_model: Any, plan: Plan, *inputs: Any, kwargs: Mapping[str, Any] | None = None,
           loss_fn: Any = None, device: str = "cpu", repeat: int = 5, seed: int = 1,
           **stray: Any) -> VerifyReport:
    """Compare one plain and one planned real step of a Workload or ``model, *inputs``
    (``kwargs``: inputs the forward takes by keyword)."""
    refuse_stray(verify, stray)
    if repeat < 1:
        raise bad_arg("repeat", "an integer >= 1", repeat, "Use repeat=5 (the default).")
    kw = check_kwargs(kwargs)
    plain_model, planned_model, inputs, loss_fn = _pair(w_or_model, inputs, kw, loss_fn, device)
    apply(planned_model, plan, inputs=inputs, kwargs=kw)  # the real ones: routing follows data
    ref = _one_step(plain_model, inputs, kw, loss_fn, seed)
    got = _one_step(planned_model, inputs, kw, loss_fn, seed)
    diffs = [(a - b).abs().max().item() if a is not None and b is not None else 0.0
             for a, b in zip(ref["grads"], got["grads"])]
    grads_equal = len(ref["grads"]) == len(got["grads"]) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(ref["grads"], got["grads"]))
    buffers_equal = all(torch.equal(a, b) for a, b in zip(ref["buffers"], got["buffers"]))
    rng_equal = all(torch.equal(a, b) for a, b in zip(ref["rng"], got["rng"]))
    planned = measure(planned_model, *inputs, kwargs=kw, loss_fn=loss_fn, simulate=False,
                      device=device, repeat=1)
    plain = measure(plain_model, *inputs, kwargs=kw, loss_fn=loss_fn, simulate=False,
                    device=device, repeat=1)
    plain_s, planned_s = step_times([(plain_model, inputs), (planned_model, inputs)], loss_fn,
                                    repeat, device, kw)
    return VerifyReport(
        grads_equal, max(diffs, default=0.0), buffers_equal, rng_equal, plan.peak_bytes,
        planned.peak_bytes, plain.peak_bytes, plan.budget_bytes, planned.allocator_peak_bytes,
        plain_s, planned_s, planned.device_name or device,
    )


def _pair(w_or_model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: Any,
          device: str) -> tuple[nn.Module, nn.Module, tuple[Any, ...], Any]:
    """Two identical models (same weights and buffers) and the inputs, on ``device``."""
    if isinstance(w_or_model, Workload):
        if inputs or kwargs or loss_fn is not None:
            raise bad_arg("inputs/kwargs/loss_fn", "nothing beside a Workload (it brings its "
                          "own)", f"{len(inputs)} inputs, {len(kwargs)} keyword inputs, "
                          f"loss_fn={loss_fn!r}", "Pass either a Workload alone or model, "
                          "*inputs, loss_fn=...")
        w = w_or_model
        with torch.device(device):
            return w.build_model(), w.build_model(), w.build_inputs(), w.loss
    if not isinstance(w_or_model, nn.Module):
        raise bad_arg("model", "a memplan Workload or a torch.nn.Module",
                      type(w_or_model).__name__, "Pass a built-in workload or your model.")
    if not inputs and not kwargs:
        raise bad_arg("inputs", "example inputs after the model (or kwargs=)", "none",
                      "Call verify(model, plan, x, loss_fn=...).")
    model = w_or_model
    return model, copy.deepcopy(model), inputs, loss_fn or default_loss


def _one_step(model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: Any,
              seed: int) -> dict[str, Any]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss_fn(model(*inputs, **kwargs)).backward()
    rng = [torch.get_rng_state()]
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        rng.append(torch.cuda.get_rng_state())
    return {"grads": [p.grad for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()], "rng": rng}
