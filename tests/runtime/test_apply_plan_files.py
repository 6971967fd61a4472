"""``memplan.apply(model, path)`` with untrusted plan files (issue 12, item 6): a mutated plan
file raises a MemplanError and leaves the model untouched, or it loads, applies and trains
with gradients equal to plain PyTorch."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import memplan
from memplan.errors import MemplanError
from tests.core.test_plan_schema import EXAMPLES, mutated


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU())
                            for _ in range(4)), nn.Linear(8, 2))
    return model, torch.randn(4, 8)


@functools.cache
def _plans() -> tuple[dict[str, Any], ...]:
    model, x = _model()
    return tuple(json.loads(memplan.plan(model, x, planner=p).to_json())
                 for p in ("recursive", "drop-cheap", "sqrt"))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).float().mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@settings(max_examples=max(10, EXAMPLES // 8), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated(_plans()))
def test_mutated_plan_files_raise_memplan_errors_or_train_exactly(text: str) -> None:
    model, x = _model()
    expected = _grads(model, x)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        path.write_text(text)
        try:
            memplan.apply(model, str(path))
        except MemplanError:
            assert "forward" not in model.__dict__  # untouched
            return
    got = _grads(model, x)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
