"""Loops users write around torch's own modules, for the capture benchmark (``capture.py``):
an embedding's output fed step by step to ``nn.LSTMCell`` / ``nn.GRUCell`` (inputs requiring
grad from outside the chain; a GRU's state read by two nodes), and one
``nn.TransformerEncoderLayer`` applied again and again (a Universal Transformer: its input read
by the attention and the residual add)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EmbeddedCells(nn.Module):
    """Token ids (steps x batch) -> embedding -> one RNN cell per step -> a head on the last."""

    def __init__(self, cell: str, vocab: int, width: int) -> None:
        super().__init__()
        self.cell_kind = cell
        self.embed = nn.Embedding(vocab, width)
        self.cell = nn.LSTMCell(width, width) if cell == "lstm" else nn.GRUCell(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = torch.zeros(tokens.shape[1], self.cell.hidden_size)
        state: Any = (h, torch.zeros_like(h)) if self.cell_kind == "lstm" else h
        for t in range(tokens.shape[0]):
            state = self.cell(x[t], state)
        return self.head(state[0] if self.cell_kind == "lstm" else state)


class Universal(nn.Module):
    """One encoder layer applied ``depth`` times to its own output (weights shared)."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.depth = depth
        self.layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1,
                                                batch_first=True)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = self.layer(x)
        return self.head(x)


def build(name: str, steps: int) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    """(model, inputs, loss_fn) of a loop: ``emb-lstmcell`` / ``emb-grucell`` (``steps``
    tokens, batch 32, width 512), ``universal`` (``steps`` applications, batch 8 x 128 x 256)."""
    torch.manual_seed(0)
    if name == "universal":
        x = torch.randn(8, 128, 256)
        return Universal(steps, 256), (x,), lambda out: out.square().mean()
    tokens = torch.randint(0, 1000, (steps, 32))
    target = torch.randint(0, 1000, (32,))
    model = EmbeddedCells(name.split("-")[1].removesuffix("cell"), 1000, 512)
    return model, (tokens,), lambda out: nn.functional.cross_entropy(out, target)
