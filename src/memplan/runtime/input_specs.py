"""The inputs a plan was made for, against a forward's: their specs (shape and dtype of each
tensor, by position and keyword), shown in messages, and the warning when they differ (the
plan's stages still hold; its memory scales with the inputs)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from memplan.core.budget import format_bytes
from memplan.core.plan import Plan
from memplan.tracing.fake import DTYPES

# Inputs as (label, (shape, dtype) of a tensor or None), labelled by position or keyword.
Spec = tuple[tuple[str, Any], ...]


def spec_text(spec: Spec) -> str:
    def one(label: str, s: Any) -> str:
        shown = "-" if s is None else f"{list(s[0])} {str(s[1]).removeprefix('torch.')}"
        return shown if label.isdigit() else f"{label}={shown}"

    # Positions shown all ("-": not a tensor), keywords only where a tensor.
    return ", ".join(one(label, s) for label, s in spec if s is not None or label.isdigit())


def _tensor_spec(a: Any) -> Any:
    return (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None


def input_spec(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Spec:
    return (tuple((str(i), _tensor_spec(a)) for i, a in enumerate(args))
            + tuple((k, _tensor_spec(v)) for k, v in (kwargs or {}).items()))


def plan_spec(plan: Plan) -> Spec:
    def one(s: dict[str, Any]) -> Any:
        return (tuple(s["shape"]), DTYPES[s["dtype"]]) if "shape" in s else None

    fwd = plan.forward
    if fwd is None:
        return ()
    return (tuple((str(i), one(s)) for i, s in enumerate(fwd.inputs))
            + tuple((k, one(s)) for k, s in fwd.kwargs.items()))


def warn_other_inputs(plan: Plan, weight_bytes: int, warned: set[Spec], args: tuple[Any, ...],
                      kwargs: dict[str, Any] | None = None, stacklevel: int = 4) -> None:
    """Warn, once per input shape, when a forward's tensor inputs differ from the plan's:
    the plan's stages still hold, its memory does not (predicted peak scaled by the inputs'
    size: activations grow with the batch, weights do not). Inputs are compared by position
    and by keyword; one passed one way here and the other in the plan is not compared."""
    planned = dict(plan_spec(plan))
    got = tuple((k, s) for k, s in input_spec(args, kwargs) if k in planned)
    want = tuple((k, planned[k]) for k, _ in got)
    if got == want or got in warned or len(warned) > 16:
        return
    warned.add(got)
    ratio = 1.0
    for (_, w), (_, h) in zip(want, got):
        if w is not None and h is not None:
            old = _numel(w[0]) * w[1].itemsize
            ratio = max(ratio, _numel(h[0]) * h[1].itemsize / old if old else 1.0)
    fixed = min(weight_bytes, plan.peak_bytes)
    scaled = int(fixed + (plan.peak_bytes - fixed) * ratio)
    over = ""
    if plan.budget_bytes is not None and scaled > plan.budget_bytes:
        over = f", over its budget of {format_bytes(plan.budget_bytes)}"
    warnings.warn(
        f"memplan: the plan was made for inputs {spec_text(want)}; this forward's are "
        f"{spec_text(got)}. Gradients stay exact, but its predicted peak of "
        f"{format_bytes(plan.peak_bytes)} becomes about {format_bytes(scaled)} (scaled by "
        f"the inputs' size){over}. Make a plan for these inputs: memplan.plan(model, *inputs, "
        "loss_fn=..., budget=...), then memplan.unapply(model) and memplan.apply(model, plan).",
        stacklevel=stacklevel)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
