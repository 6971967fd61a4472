"""One zoo entry, plain and planned, through memplan's public API; every failure classified.

Activation memory and the budget (issue 11's "half the activation memory"):
  base        = parameters + buffers + inputs + other tensors that exist before the step
                (targets a loss closes over), as memplan's real tracker counts them at the
                peak of one plain step (``memplan.measure(..., simulate=False)``);
  activation  = plain peak - base (activations, gradients, backward temporaries);
  budget      = base + activation // 2.
An entry passes when one plain and one planned real step (same seed, 1 thread) give
``torch.equal`` loss, gradients, buffers and RNG state, and the planned step's peak measured
by the same tracker is <= the budget and <= the plan's predicted peak.

Run one entry in its own process (a capture can hang): ``python -m tests.zoo.check NAME``
from the repository root; it prints ``zoo-phase ...`` lines as it goes and one
``zoo-result {json}`` line at the end.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

import memplan
from tests.zoo import split

PHASE = "zoo-phase "
RESULT = "zoo-result "
CONSTANT_KINDS = ("parameter", "buffer", "input", "external")

# Failure classes (issue 11's list); a row's ``failure`` is one of these, prefixed by the
# phase for the exception classes.
CLOSURE = "closure over real tensor"
DATA_DEPENDENT = "data-dependent op"
GROUPED_MM = "grouped_mm meta"
NO_PLAN = "planner: no plan under budget"
BELOW_FLOOR = "planner: budget below the floor"  # no plan of these ops can fit (core.floor)
OVER_PREDICTED = "budget broken: measured > predicted"
OVER_BUDGET = "budget broken: measured > budget"
NOT_EXACT = "gradients differ"


@dataclass
class Row:
    model: str
    library: str
    planner: str
    status: str = "fail"  # pass | fail | skipped
    failure: str = ""  # the failure class, "" on pass
    detail: str = ""  # the exception's type and first line, or the figures
    phase: str = ""  # where it stopped
    base_bytes: int = 0
    plain_peak_bytes: int = 0
    budget_bytes: int = 0
    predicted_peak_bytes: int = 0
    planned_peak_bytes: int = 0
    least_peak_bytes: int = 0  # the planner's least peak, when it refused the budget
    extra_flops_fraction: float = 0.0
    capture_s: float = 0.0
    plan_s: float = 0.0
    total_s: float = 0.0


def check(name: str, planner: str = "optimal", seed: int = 0,
          phase: Callable[[str], None] = lambda _: None) -> Row:
    """Run entry ``name`` plain and planned; never raises for the model's or memplan's faults."""
    from tests.zoo import ZOO, installed

    entry = ZOO[name]
    row = Row(name, entry.library, planner)
    if not installed(entry.library):
        row.status, row.failure = "skipped", f"skipped: library {entry.library} not installed"
        return row
    return run_build(entry.build, row, seed, phase)


def run_build(build: Callable[[int], Any], row: Row, seed: int = 0,
              phase: Callable[[str], None] = lambda _: None) -> Row:
    """``evaluate`` with every exception classified into ``row``; returns ``row``."""
    t0 = time.perf_counter()
    try:
        evaluate(build, row, seed, phase)
    except Exception as exc:  # noqa: BLE001 -- classified, not hidden
        row.failure, row.detail = classify(row.phase, exc)
    row.total_s = time.perf_counter() - t0
    return row


def evaluate(build: Callable[[int], Any], row: Row, seed: int = 0,
             phase: Callable[[str], None] = lambda _: None) -> None:
    """Fill ``row`` from one plain and one planned step of ``build(seed)``'s model; a refused
    budget, a broken budget or an inexact step set ``row.failure``, exceptions propagate."""
    def at(name: str) -> None:
        row.phase = name
        phase(name)

    at("build")
    model, example, loss_fn = build(seed)
    inputs, kwargs = split(example)
    pristine = copy.deepcopy(model)  # measured steps update BatchNorm statistics: copy first
    at("measure plain")
    plain = memplan.measure(copy.deepcopy(pristine), *inputs, kwargs=kwargs, loss_fn=loss_fn,
                            simulate=False, repeat=1)
    row.plain_peak_bytes = plain.peak_bytes
    row.base_bytes = sum(plain.breakdown_at_peak.get(k, 0) for k in CONSTANT_KINDS)
    row.budget_bytes = row.base_bytes + (row.plain_peak_bytes - row.base_bytes) // 2
    at("capture")
    t = time.perf_counter()
    graph = memplan.capture(copy.deepcopy(pristine), *inputs, kwargs=kwargs, loss_fn=loss_fn)
    row.capture_s = time.perf_counter() - t
    at("plan")
    t = time.perf_counter()
    try:
        plan = memplan.plan(graph, budget=row.budget_bytes, planner=row.planner)
    except memplan.BudgetTooSmall as exc:
        row.plan_s = time.perf_counter() - t
        row.least_peak_bytes = exc.least_peak_bytes
        below = exc.floor_bytes is not None and row.budget_bytes < exc.floor_bytes
        row.failure = BELOW_FLOOR if below else NO_PLAN
        row.detail = (f"least peak {exc.least_peak_bytes:,} B = "
                      f"{exc.least_peak_bytes / row.plain_peak_bytes:.2f}x plain (measured "
                      f"{row.plain_peak_bytes:,} B); budget "
                      f"{row.budget_bytes / row.plain_peak_bytes:.2f}x plain")
        if exc.floor_bytes is not None:
            row.detail += f"; floor {exc.floor_bytes / row.plain_peak_bytes:.2f}x plain"
        return
    row.plan_s = time.perf_counter() - t
    row.predicted_peak_bytes = plan.peak_bytes
    row.extra_flops_fraction = plan.extra_fraction
    at("apply")
    reference, planned = copy.deepcopy(pristine), copy.deepcopy(pristine)
    memplan.apply(planned, plan)
    at("step")
    differ = compare(step(reference, inputs, kwargs, loss_fn, seed),
                     step(planned, inputs, kwargs, loss_fn, seed))
    at("measure planned")
    row.planned_peak_bytes = memplan.measure(planned, *inputs, kwargs=kwargs, loss_fn=loss_fn,
                                             simulate=False, repeat=1).peak_bytes
    row.failure, row.detail = verdict(row, differ)
    row.status = "pass" if not row.failure else "fail"


def step(model: torch.nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
         loss_fn: Callable[[Any], Any], seed: int) -> dict[str, Any]:
    """One real training step from None grads; what must be bit-equal afterwards."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model(*inputs, **kwargs))
    loss.backward()
    return {
        "loss": [loss.detach()],
        "gradients": [p.grad for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "RNG state": [torch.get_rng_state()],
    }


def compare(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The parts of two steps that are not ``torch.equal``, with the largest difference."""
    differ = []
    for part, tensors in ref.items():
        pairs = list(zip(tensors, got[part]))
        bad = [(a, b) for a, b in pairs if not _equal(a, b)]
        if bad or len(tensors) != len(got[part]):
            worst = max((float((a.double() - b.double()).abs().max()) for a, b in bad
                         if a is not None and b is not None and a.is_floating_point()
                         and a.shape == b.shape), default=float("nan"))
            differ.append(f"{part} ({len(bad)} of {len(pairs)}, max |diff| {worst:.3g})")
    return differ


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def verdict(row: Row, differ: list[str]) -> tuple[str, str]:
    figures = (f"measured {row.planned_peak_bytes:,} B, predicted {row.predicted_peak_bytes:,}"
               f" B, budget {row.budget_bytes:,} B, plain {row.plain_peak_bytes:,} B")
    if differ:
        return NOT_EXACT, "; ".join(differ)
    if row.planned_peak_bytes > row.predicted_peak_bytes:
        over = row.planned_peak_bytes / row.predicted_peak_bytes - 1
        return OVER_PREDICTED, f"+{over:.1%}: {figures}"
    if row.planned_peak_bytes > row.budget_bytes:
        over = row.planned_peak_bytes / row.budget_bytes - 1
        return OVER_BUDGET, f"+{over:.1%}: {figures}"
    return "", figures


def classify(phase: str, exc: BaseException) -> tuple[str, str]:
    """(failure class, detail) of an exception raised in ``phase``."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    text = str(exc)
    lines = text.strip().splitlines()
    detail = f"{type(exc).__name__}: {lines[0][:240] if lines else ''}"
    if "grouped_mm" in text or "Expected inputs of BF16 type" in text:  # _grouped_mm's meta
        return f"{phase}: {GROUPED_MM}", detail
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException,
                        GuardOnDataDependentSymNode)) or "data-dependent" in text:
        return f"{phase}: {DATA_DEPENDENT}", detail
    if "convert all Tensors to FakeTensors" in text:
        return f"{phase}: {CLOSURE}", detail
    return f"{phase}: other", detail


class ZooFailure(Exception):
    """An entry's failure, raised by ``raise_for``: tests mark the class they expect."""


class ClosureOverRealTensor(ZooFailure):
    pass


class DataDependentOp(ZooFailure):
    pass


class GroupedMMMeta(ZooFailure):
    pass


class Deadlock(ZooFailure):
    pass


class NoPlanUnderBudget(ZooFailure):
    pass


class BudgetBroken(ZooFailure):
    pass


class NotExact(ZooFailure):
    pass


_RAISES = {CLOSURE: ClosureOverRealTensor, DATA_DEPENDENT: DataDependentOp,
           GROUPED_MM: GroupedMMMeta, "deadlock": Deadlock, NO_PLAN: NoPlanUnderBudget,
           BELOW_FLOOR: NoPlanUnderBudget,
           "budget broken": BudgetBroken, NOT_EXACT: NotExact}


def failure_type(failure: str) -> type[ZooFailure]:
    """The ZooFailure subclass of a failure class (ZooFailure itself for the others)."""
    return next((cls for key, cls in _RAISES.items() if key in failure), ZooFailure)


def raise_for(row: Row) -> None:
    """Raise the ZooFailure of ``row``'s failure class; nothing when the row passed."""
    if row.status != "pass":
        raise failure_type(row.failure)(f"{row.model} [{row.planner}]: {row.failure}: "
                                        f"{row.detail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one zoo entry plain and planned.")
    parser.add_argument("name")
    parser.add_argument("--planner", default="optimal")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("MEMPLAN_TEST_THREADS", "1")))
    faulthandler.register(signal.SIGUSR1)  # the runner asks for the stacks of a hung run

    def phase(name: str) -> None:
        print(PHASE + name, flush=True)

    row = check(args.name, args.planner, args.seed, phase)
    print(RESULT + json.dumps(asdict(row)), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
