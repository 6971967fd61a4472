from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

import memplan
from memplan.core.graph import ACTIVATION, CALL, PARAMETER, Graph
from tests.builders import StackedCellLoop, cell_loop_inputs
from tests.small import small


def _wrapped_number(t: torch.Tensor) -> bool:
    """A Python scalar autograd wrapped (``x * 0.5`` saves 0.5, ``x / 4`` saves 4): a 0-dim
    tensor of Python's float, int or complex dtype. The small models make no such tensors of
    their own."""
    return t.dim() == 0 and t.dtype in (torch.float64, torch.int64, torch.complex128)


def _autograd_saved_bytes(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn) -> int:
    """What autograd really saves, read off the autograd graph's ``_saved_*`` attributes of a
    real (not fake) forward: independent of memplan's saved-tensor hooks. Wrapped Python
    scalars are host scalars no tracker counts (memplan tracks them at 0 bytes)."""
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    loss = loss_fn(model(*inputs))
    seen: dict[int, int] = {}
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for attr in dir(node):
            if attr.startswith("_saved_"):
                val = getattr(node, attr)
                for t in val if isinstance(val, (tuple, list)) else [val]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() \
                            and not _wrapped_number(t):
                        ptr = t.untyped_storage().data_ptr()
                        if ptr not in exclude:
                            seen[ptr] = t.untyped_storage().nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(seen.values())


@pytest.mark.parametrize("name", ["resnet", "lstm", "gpt"])
def test_saved_bytes_equal_what_autograd_saves(name: str) -> None:
    w = small(name)
    graph = memplan.capture(w)
    assert graph.saved_bytes == _autograd_saved_bytes(w.build_model(), w.build_inputs(), w.loss)
    assert graph.saved_bytes > 0


@pytest.mark.parametrize("name", ["resnet", "lstm", "gpt"])
def test_capture_is_deterministic(name: str) -> None:
    a, b = memplan.capture(small(name, dropout=0.1)), memplan.capture(small(name, dropout=0.1))
    assert a.to_json() == b.to_json()
    assert a.fingerprint == b.fingerprint


def test_graph_round_trips_through_json() -> None:
    graph = memplan.capture(small("gpt"))
    again = Graph.from_dict(json.loads(graph.to_json()))
    assert again == graph and again.fingerprint == graph.fingerprint


def test_resnet_graph_structure() -> None:
    graph = memplan.capture(small("resnet"))
    targets = [op.target for op in graph.ops]
    # depth 14 -> 4 bottleneck units: 13 convs + stem + 2 projection shortcuts... counted exactly
    assert targets.count("aten.convolution.default") == 1 + 4 * 3 + 4
    conv = next(op for op in graph.ops if op.target == "aten.convolution.default")
    assert conv.module == "net.stem.0" and conv.fwd_flops > 0 and conv.bwd_flops > 0
    # Every forward op has its backward attributed; FLOPs add up.
    assert graph.step_flops == graph.fwd_flops + graph.bwd_flops
    assert sum(op.bwd_flops for op in graph.ops) <= graph.bwd_flops
    # A cut after every residual unit, each holding exactly the unit's output.
    unit_cuts = [c for c in graph.cut_points if c.module.count(".") == 3]
    assert [c.module for c in unit_cuts] == [f"net.stages.{i}.0" for i in range(4)]
    for cut in unit_cuts:
        (vid,) = cut.live
        value = graph.values[vid]
        assert value.kind == ACTIVATION and cut.live_bytes == value.nbytes
        assert graph.ops[value.producer].target == "aten.relu.default"
    # Parameters are never counted as saved.
    saved = {v for op in graph.ops for v in op.saved}
    assert all(graph.values[v].kind != PARAMETER for v in saved)


def test_lstm_step_boundaries_are_cuts() -> None:
    graph = memplan.capture(small("lstm"))
    steps = [c for c in graph.cut_points if c.module == "step"]
    assert len(steps) == 4
    hidden_state_bytes = 2 * 32 * 4
    for cut in steps[:-1]:  # (h, c) of 4 layers + the running loss (a 0-d float)
        assert cut.live_bytes == 4 * 2 * hidden_state_bytes + 4
    assert steps[-1].live_bytes == 4  # after the last step only the summed loss goes on


def test_a_loop_over_cells_gets_a_cut_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop over nn.LSTMCell has no call per step to cut after: its cuts are fine cuts.
    Up to ``MAX_FINE`` of them all are kept; fewer are spread evenly, one per run of equal
    saved bytes: with as many as steps, one per step, at the same place in every step (the
    old rule, at most 32 per gap, left a 1024-step LSTM 32-step stages)."""
    from memplan.core import liveness

    steps = 48
    graph = memplan.capture(StackedCellLoop(), *cell_loop_inputs(steps), loss_fn=lambda out: out)
    starts = [c.start for c in graph.module_calls if c.path == "out"]
    step_ops = starts[1] - starts[0]
    first_cell = min(c.start for c in graph.module_calls if c.path == "cells.0")

    def cuts(most: int) -> list[int]:
        monkeypatch.setattr(liveness, "MAX_FINE", most)
        found = liveness.cut_points(graph.values, graph.ops, graph.module_calls, graph.outputs)
        return [c.after for c in found]

    assert [c.after for c in graph.cut_points] == cuts(1024)
    for most, every in ((48, 1), (16, 3)):
        found = cuts(most)
        assert len(found) == most + 1  # and the forward's end
        assert found[0] >= first_cell  # not before anything is saved (an empty stage)
        # (the first and the last step's cut: at their narrowest point, not the step's end)
        inner = found[1:-2]
        assert {b - a for a, b in itertools.pairwise(inner)} == {every * step_ops}
    assert set(cuts(48)) <= set(cuts(1024))


def test_fine_cuts_of_mixed_stages_are_fewer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many fine cuts plan fast only where their stages repeat (the planner solves identical
    ones once). A flat nn.Sequential of blocks of one width keeps a cut per block; of
    varying widths, its cuts are halved down to ``MAX_FINE_MIXED``."""
    from memplan.core import liveness

    monkeypatch.setattr(liveness, "MAX_FINE", 32)
    monkeypatch.setattr(liveness, "MAX_FINE_MIXED", 8)
    monkeypatch.setattr(liveness, "MIN_FINE", 4)
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    widths = [8, 24, 16, 40, 8, 32, 24, 16, 48, 8, 16, 40, 24, 8, 32, 16, 8]
    mixed = nn.Sequential(*[m for a, b in itertools.pairwise(widths)
                            for m in (nn.Linear(a, b), nn.LayerNorm(b), nn.GELU())])
    same = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(8, 8), nn.LayerNorm(8),
                                                          nn.GELU())])

    def fine_cuts(model: nn.Module) -> list[str]:
        graph = memplan.capture(model, x, loss_fn=lambda out: out.square().mean())
        return [c.module for c in graph.cut_points if c.kind != CALL]

    assert len(fine_cuts(same)) == 15  # one per block; the last block's: the forward's end
    assert 0 < len(fine_cuts(mixed)) <= 8


def test_a_loops_initial_state_is_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's initial state, one zeros tensor in a local variable of forward, is held to
    the forward's end across every step's op-boundary cut: resident, counted once, not in
    every checkpoint (each then held 96 B more, and the paper's LSTM written this way planned
    44.8 % extra at 0.5 GB instead of 42.2 %)."""
    from memplan.core import chain as C
    from memplan.core import liveness

    monkeypatch.setattr(liveness, "MAX_FINE", 48)  # one cut per step
    graph = memplan.capture(StackedCellLoop(), *cell_loop_inputs(48), loss_fn=lambda out: out)
    chain = C.build_chain(graph)
    state_bytes = 2 * 2 * 3 * 8 * 4  # (h, c) of two layers, batch 3, width 8
    assert set(chain.x[1:-2].tolist()) == {state_bytes + 4}  # and the running loss


def test_capture_user_model_with_loss_fn() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    before = [p.detach().clone() for p in model.parameters()]
    graph = memplan.capture(model, x, loss_fn=lambda out: out.pow(2).mean())
    assert graph.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert any(op.target == "aten.addmm.default" for op in graph.ops)
    # The user's model is untouched: no grads, same weights.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_capture_errors_name_the_problem() -> None:
    model = nn.Linear(3, 3)
    with pytest.raises(memplan.MemplanError, match="inputs"):
        memplan.capture(model)
    with pytest.raises(memplan.MemplanError, match="model"):
        memplan.capture("resnet")
    with pytest.raises(memplan.MemplanError, match="loss_fn"):
        memplan.capture(model, torch.randn(2, 3), loss_fn=lambda out: out)
