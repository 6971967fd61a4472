from __future__ import annotations

import pytest
import torch

import memplan
from memplan.models.resnet import units_for_depth
from tests.small import small


def test_resnet_depth_layout_follows_memonger() -> None:
    assert units_for_depth(1000) == (3, 24, 303, 3)
    assert units_for_depth(50) == (3, 4, 6, 3)
    for depth in (128, 256, 512, 1024):
        units = units_for_depth(depth)
        assert units[0] == 3 and units[1] == 24 and units[3] == 3
        assert 3 * sum(units) + 1 == depth - (depth - 1) % 3


def test_get_builds_nothing_and_validates() -> None:
    w = memplan.models.get("resnet", depth=1000, batch=32)
    assert w.params["depth"] == 1000 and w.spec.startswith("resnet:")
    with pytest.raises(memplan.ConfigError, match="resnet parameter"):
        memplan.models.get("resnet", layers=3)
    with pytest.raises(memplan.ConfigError, match="an integer >= 1"):
        memplan.models.get("lstm", steps=0)
    with pytest.raises(memplan.ConfigError, match="dropout"):
        memplan.models.get("gpt", dropout=1.5)
    with pytest.raises(memplan.MemplanError, match="one of"):
        memplan.models.get("vgg")


@pytest.mark.parametrize("name", ["resnet", "lstm", "gpt"])
def test_models_train_and_are_deterministic(name: str) -> None:
    w = small(name, dropout=0.1)
    grads = []
    for _ in range(2):
        model = w.build_model()
        torch.manual_seed(0)
        w.loss(model(*w.build_inputs())).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_lstm_shares_weights_across_steps() -> None:
    model = small("lstm").build_model()
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == 4 * 2 + 2  # 4 cells (weight, bias) + classifier, no per-step copies
