"""The evaluator (``memplan.core.evaluate``: the runtime's semantics on the captured graph)
against the runtime itself: the peak of a step run by ``memplan.apply``, measured by memplan's
tracker for real on CPU and on fake tensors, equals the evaluated peak to the byte; so plans
(whose ``peak_bytes`` is that evaluation) keep their budgets. Leaf-module and op boundaries
(flat nn.Sequential, functional code) apply exactly."""

from __future__ import annotations

import copy
import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memplan
from memplan.core.evaluate import evaluate
from memplan.core.graph import LEAF, OP, Graph
from memplan.runtime.apply import applied_state
from tests.builders import (
    CustomFunctionMLP,
    FunctionalMLP,
    flat_mlp,
    mlp_input,
    rope_inputs,
    rope_loss,
    square_loss,
    unet_inputs,
    unet_loss,
)
from tests.small import small

Case = tuple[Callable[[], nn.Module], tuple[Any, ...], Callable[[Any], torch.Tensor]]


def _workload(name: str) -> Case:
    w = small(name, dropout=0.1)
    return w.build_model, w.build_inputs(), w.loss


def _user(build: Callable[[], tuple[Any, ...]], loss: Callable[[Any], torch.Tensor]) -> Case:
    model, *inputs = build()
    return (lambda: copy.deepcopy(model)), tuple(inputs), loss


CASES: dict[str, Callable[[], Case]] = {
    "resnet": lambda: _workload("resnet"),
    "lstm": lambda: _workload("lstm"),
    "gpt": lambda: _workload("gpt"),
    "unet": lambda: _user(unet_inputs, unet_loss),
    "rope": lambda: _user(rope_inputs, rope_loss),
    "flat": lambda: _user(lambda: (flat_mlp(), mlp_input()), square_loss),
    "functional": lambda: _user(lambda: (FunctionalMLP(), mlp_input()), square_loss),
    "custom-function": lambda: _user(lambda: (CustomFunctionMLP(), mlp_input()), square_loss),
}
PLANNERS = ("sqrt", "drop-cheap", "recursive", "optimal", "optimal@half")


@functools.cache
def _case(name: str) -> tuple[Case, Graph]:
    case = CASES[name]()
    build, inputs, loss = case
    return case, memplan.capture(build(), *inputs, loss_fn=loss)


@functools.cache
def _plan(name: str, planner: str) -> memplan.Plan:
    _, graph = _case(name)
    if planner == "optimal@half":  # halfway between the least and the plain peak
        least = memplan.plan(graph)
        return memplan.plan(graph, budget=(least.peak_bytes + graph.peak_bytes) // 2)
    return memplan.plan(graph, planner=planner)


@functools.cache
def _measured(name: str, planner: str, simulate: bool) -> int:
    (build, inputs, loss), _ = _case(name)
    model = memplan.apply(build(), _plan(name, planner))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a stage the runtime missed would warn
        return memplan.measure(model, *inputs, loss_fn=loss, simulate=simulate,
                               repeat=1).peak_bytes


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_evaluated_peak_equals_real_run(name: str, planner: str) -> None:
    plan = _plan(name, planner)
    assert plan.peak_bytes == evaluate(_case(name)[1], plan).peak_bytes
    assert _measured(name, planner, simulate=False) == plan.peak_bytes
    if plan.budget_bytes is not None:
        assert plan.peak_bytes <= plan.budget_bytes


# Issue 14.6: a simulated step of an applied model (fake copies of its parameters and buffers)
# allocates what the real one does, BatchNorm statistics' copies included.
@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_simulated_run_equals_real_run(name: str, planner: str) -> None:
    assert _measured(name, planner, simulate=True) == _measured(name, planner, simulate=False)


def _step(model: nn.Module, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor]
          ) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out = loss(model(*inputs))
    out.backward()  # type: ignore[no-untyped-call]
    return ([out.detach()] + [p.grad for p in model.parameters() if p.grad is not None]
            + [b.clone() for b in model.buffers()] + [torch.get_rng_state()])


@pytest.mark.parametrize("name,kind", [("flat", LEAF), ("functional", OP)])
def test_fine_boundaries_apply_exactly(name: str, kind: str) -> None:
    """Stages that end at a leaf module's call (a forward hook) or after an op of functional
    code (the runtime counts ops): gradients, buffers and RNG equal plain PyTorch and every
    boundary is passed (its real peak is the plan's: test_evaluated_peak_equals_real_run)."""
    (build, inputs, loss), _ = _case(name)
    plan = _plan(name, "optimal")
    assert any(s.boundary == kind and s.mode != "keep" for s in plan.stages)
    model = memplan.apply(build(), plan)
    ref = _step(build(), inputs, loss)
    got = _step(model, inputs, loss)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
    state = applied_state(model)
    assert state is not None and state.last is not None and state.last.finished
    assert state.last.stage == len(state.layout.end_calls) - 1


@pytest.mark.parametrize("planner", ["sqrt", "optimal@half"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_headroom_is_what_replays_leave_below_the_peak(name: str, planner: str) -> None:
    """``Stage.replay_headroom_bytes`` (what runtime.units may keep beyond the op tape): none
    for a stage not recomputed, none where a replay makes the step's peak (the sqrt plans of
    resnet and unet), and never more than the peak. That the step's measured peak stays the
    plan's with units using it is ``test_evaluated_peak_equals_real_run``."""
    plan = _plan(name, planner)
    graph = _case(name)[1]
    ev = evaluate(graph, plan)
    for st in plan.stages:
        if st.mode != "recompute":
            assert st.replay_headroom_bytes == 0
        assert 0 <= st.replay_headroom_bytes <= plan.peak_bytes
    match = re.fullmatch(r"replay of ops \d+\.\.\d+, op (\d+)", ev.peak_at)
    if match:
        op = int(match.group(1))
        at = next(st for st in plan.stages if st.first_op <= op <= st.last_op)
        assert at.replay_headroom_bytes == 0
