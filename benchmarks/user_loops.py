"""Loops users write around torch's own modules, for the capture and planner benchmarks
(``capture.py``, ``planners.py``): an embedding's output fed step by step to ``nn.LSTMCell`` /
``nn.GRUCell`` (inputs requiring grad from outside the chain; a GRU's state read by two nodes),
one ``nn.TransformerEncoderLayer`` applied again and again (a Universal Transformer: its input
read by the attention and the residual add), and the paper's LSTM written as a loop over four
``nn.LSTMCell`` layers (no module per step: its cut points are op boundaries)."""

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
        out: torch.Tensor = self.head(state[0] if self.cell_kind == "lstm" else state)
        return out


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
        out: torch.Tensor = self.head(x)
        return out


class CellLSTM(nn.Module):
    """The paper's LSTM (Sec. 5.3: 4 x 1024, a 50-dim input, batch 64, a 5000-way softmax at
    every step) as a user writes it from ``nn.LSTMCell``: forward(x, y) -> the mean per-step
    cross-entropy. Issue 14's independent build (plain peak 9.15 GB at T=1024) is this one."""

    def __init__(self, inp: int = 50, hidden: int = 1024, layers: int = 4,
                 classes: int = 5000, residual: bool = False) -> None:
        super().__init__()
        self.residual = residual  # GNMT's stack: each upper layer's input added to its output
        self.cells = nn.ModuleList(nn.LSTMCell(inp if i == 0 else hidden, hidden)
                                   for i in range(layers))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        steps, batch = x.shape[:2]
        zeros = x.new_zeros(batch, self.out.in_features)
        state = [(zeros, zeros) for _ in self.cells]
        loss = x.new_zeros(())
        for t in range(steps):
            h = x[t]
            for i, cell in enumerate(self.cells):
                state[i] = cell(h, state[i])
                h = state[i][0] + h if self.residual and i else state[i][0]
            loss = loss + nn.functional.cross_entropy(self.out(h), y[t], reduction="sum")
        return loss / (steps * batch)


def build(name: str, steps: int) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    """(model, inputs, loss_fn) of a loop: ``emb-lstmcell`` / ``emb-grucell`` (``steps``
    tokens, batch 32, width 512), ``universal`` (``steps`` applications, batch 8 x 128 x 256),
    ``paper-lstmcell`` (``steps`` steps; ``CellLSTM``), ``residual-lstmcell`` (the same with
    GNMT's residual adds)."""
    torch.manual_seed(0)
    if name in ("paper-lstmcell", "residual-lstmcell"):
        x, y = torch.randn(steps, 64, 50), torch.randint(0, 5000, (steps, 64))
        return CellLSTM(residual=name == "residual-lstmcell"), (x, y), lambda out: out
    if name == "universal":
        x = torch.randn(8, 128, 256)
        return Universal(steps, 256), (x,), lambda out: out.square().mean()
    tokens = torch.randint(0, 1000, (steps, 32))
    target = torch.randint(0, 1000, (32,))
    model = EmbeddedCells(name.split("-")[1].removesuffix("cell"), 1000, 512)
    return model, (tokens,), lambda out: nn.functional.cross_entropy(out, target)
