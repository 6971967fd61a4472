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


def exits() -> None:
    raise SystemExit(3)  # as sys.exit(3) in a user's script


class _BrokenForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("this forward is broken")


def broken_forward() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return _BrokenForward(), (torch.randn(2, 16),)


# Rich markup and terminal escapes in module names: printed as they are, never obeyed.
ODD_NAMES = ("[/red]", "[bold]b", "\x1b[2Jc", ":llama:")


class _OddNames(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({name: nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                                     for name in ODD_NAMES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def odd_names() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return _OddNames(), (torch.randn(4, 16),)


llama = odd_names  # a factory name that is an emoji code in a title ("...:llama: plan")


class KeywordInputs(nn.Module):
    """A forward that takes its inputs by keyword, as Hugging Face models do
    (``model(**batch)``): a mask that changes the ops (None: no masking), a Python float."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Tanh())
                                    for _ in range(6))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if mask is not None:
                x = x * mask[:, None]
        out: torch.Tensor = self.head(x) * scale
        return out


def keyword_batch(batch: int = 256) -> dict[str, object]:
    return {"x": torch.randn(batch, 16), "mask": (torch.arange(batch) % 3 != 0).float(),
            "scale": 0.5}


def make_keywords() -> tuple[nn.Module, dict[str, object], object]:
    """A factory whose example inputs are keyword inputs (a dict)."""
    torch.manual_seed(0)
    return KeywordInputs(), keyword_batch(), lambda out: out.square().mean()
