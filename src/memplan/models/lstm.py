"""The paper's LSTM (Sec. 5.3): 4 stacked layers, hidden 1024, a 50-dim continuous input per
step, batch 64, softmax over 5000 classes at every step, unrolled over T steps with cells.

The per-step softmax loss is computed inside each step, as MXNet's per-step ``SoftmaxOutput``
does, so the boundary between two steps is only the (h, c) state of every layer and the running
loss: the chain the paper's planner cuts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LSTMCell(nn.Module):
    """One LSTM layer for one step: gates from one matmul over [x, h]."""

    def __init__(self, input_size: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.gates = nn.Linear(input_size + hidden, 4 * hidden)

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gates = self.gates(torch.cat([x, h], dim=1))
        i, f, g, o = gates.chunk(4, dim=1)
        c_next = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h_next = torch.sigmoid(o) * torch.tanh(c_next)
        return h_next, c_next


class LSTMStep(nn.Module):
    """All layers at one time step, then the classifier and that step's loss."""

    def __init__(self, cells: nn.ModuleList, classifier: nn.Linear, dropout: float) -> None:
        super().__init__()
        # Shared with the parent: every step uses the same weights (unrolled, not copied).
        self.cells = cells
        self.classifier = classifier
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        state: list[tuple[torch.Tensor, torch.Tensor]],
        loss: torch.Tensor,
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        new_state = []
        inp = x
        for cell, (h, c) in zip(self.cells, state):
            h, c = cell(inp, h, c)
            new_state.append((h, c))
            inp = self.dropout(h)
        logits = self.classifier(inp)
        return new_state, loss + F.cross_entropy(logits, target, reduction="sum")


class LSTM(nn.Module):
    """forward(x[T, B, input], target[T, B]) -> summed per-step cross-entropy (a scalar)."""

    def __init__(
        self,
        input_size: int = 50,
        hidden: int = 1024,
        layers: int = 4,
        num_classes: int = 5000,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = layers
        self.cells = nn.ModuleList(
            LSTMCell(input_size if i == 0 else hidden, hidden) for i in range(layers)
        )
        self.classifier = nn.Linear(hidden, num_classes)
        self.step = LSTMStep(self.cells, self.classifier, dropout)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        batch = x.shape[1]
        zeros = x.new_zeros(batch, self.hidden)
        state = [(zeros, zeros) for _ in range(self.layers)]
        loss = x.new_zeros(())
        for t in range(x.shape[0]):
            state, loss = self.step(x[t], target[t], state, loss)
        return loss
