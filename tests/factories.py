"""User model factories for ``memplan plan tests.factories:NAME`` in the CLI tests."""

from __future__ import annotations

import torch
from torch import nn


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(6)),
                         nn.Linear(16, 4))


def make() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _mlp(), (torch.randn(8, 16),)


def make_with_loss() -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    return _mlp(), (torch.randn(8, 16),), lambda out: out.square().mean()


def make_batch(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _mlp(), (torch.randn(batch, 16),)


def wrong_return() -> int:
    return 5


def not_a_model() -> tuple[str, tuple[torch.Tensor, ...]]:
    return "model", (torch.randn(2, 16),)


def raises() -> None:
    raise RuntimeError("no weights here")


NOT_CALLABLE = 3
