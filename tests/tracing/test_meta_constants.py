"""A model built on the meta device is captured with the ops the real model runs, where its
forward makes constants from Python data (``tracing.meta_constants``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from torch import nn

import memplan

# torch.tensor(a_tensor) warns to prefer clone(); models do it anyway, and so do these tests.
pytestmark = pytest.mark.filterwarnings("ignore:To copy construct from a tensor")


class Constants(nn.Module):
    """Constants made in the forward as models make them: on the input's device, from lists,
    scalars and an empty list (a cache to concatenate to)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([0.5] * 8, device=x.device)
        shift = x.new_tensor(0.25)
        empty = torch.as_tensor([], device=x.device, dtype=x.dtype).reshape(0, 8)
        h = torch.cat([empty, self.a(x).relu() * scale + shift])
        ones = torch.asarray([[1.0] * 8], device=x.device)
        kept = torch.tensor(torch.ones(8), device=x.device)  # from a tensor: no lift anywhere
        return self.b(h * ones + kept).tanh()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model(x)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_meta_model_captures_the_ops_of_the_real_one() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(16, 8)
    with torch.device("meta"):
        meta = Constants()
    graph = memplan.capture(meta, x.to("meta"), loss_fn=_loss)
    model = Constants()
    real = memplan.capture(model, x, loss_fn=_loss)
    assert [o.target for o in graph.ops] == [o.target for o in real.ops]
    assert sum(o.target == "aten.lift_fresh.default" for o in graph.ops) == 4
    assert graph.forward is not None and real.forward is not None
    assert graph.forward.fingerprint == real.forward.fingerprint
    assert graph.peak_bytes == real.peak_bytes
    notes = [memplan.plan(g).notes for g in (graph, real)]
    assert [any("meta device" in note for note in n) for n in notes] == [True, False]
    # The meta capture's plan applies to the real model, which trains bit-equal within it.
    plan = memplan.plan(graph, budget=(memplan.plan(graph).peak_bytes + graph.peak_bytes) // 2)
    plain = copy.deepcopy(model)
    memplan.apply(model, json.loads(plan.to_json()))
    assert all(torch.equal(a, b) for a, b in zip(_grads(plain, x), _grads(model, x),
                                                 strict=True))
    measured = memplan.measure(model, x, loss_fn=_loss, simulate=False, repeat=1)
    assert measured.peak_bytes <= plan.peak_bytes


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_constants_are_lifted_once_each(device: str) -> None:
    """What torch does on the CPU, the meta device now does within the capture."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memplan.tracing.meta_constants import lifted_meta_constants

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.ones(2, device=device)
    with lifted_meta_constants(), Ops() as ops:
        torch.tensor([1.0, 2.0], device=device)
        x.new_tensor(data=[3.0])
        torch.tensor(x)  # a copy of a tensor: detach and _to_copy, no lift
    assert ops.seen == ["aten.lift_fresh.default"] * 2 + ["aten.detach.default",
                                                            "aten._to_copy.default"]
