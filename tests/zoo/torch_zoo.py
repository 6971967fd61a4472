"""Plain PyTorch written the way users write it: a flat nn.Sequential, a loss that closes over
its targets and class weights, in-place activations on views (InstanceNorm's output too),
nn.TransformerEncoder with a padding mask, a stacked nn.LSTM, a loop over nn.LSTMCell, intermediates kept in a list,
a conv net of nested blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.zoo import Built, Entry

WIDTH, BATCH = 64, 256


def flat_sequential(seed: int) -> Built:
    """24 x (Linear, BatchNorm1d, GELU, Dropout) in one flat nn.Sequential."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.GELU(), nn.Dropout(0.1)]
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed + 1))
    return nn.Sequential(*layers).train(), (x,), lambda out: out.square().mean()


def blocks(depth: int = 12) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU(),
                                         nn.Dropout(0.1)) for _ in range(depth)),
                         nn.Linear(WIDTH, 10))


def closure_loss(seed: int) -> Built:
    """Cross entropy with class weights, closed over the targets."""
    torch.manual_seed(seed)
    model = blocks().train()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(BATCH, WIDTH, generator=g)
    targets = torch.randint(0, 10, (BATCH,), generator=g)
    weights = torch.rand(10, generator=g) + 0.5
    return model, (x,), lambda logits: F.cross_entropy(logits, targets, weight=weights)


class InplaceOnView(nn.Module):
    """``F.relu(y.view(...), inplace=True)`` on a non-leaf ``y`` between Linear layers."""

    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = layer(x)
            F.relu(y.view(-1, 8, WIDTH // 8), inplace=True)
            x = F.dropout(y, 0.1, self.training)
        return x


def inplace_on_view(seed: int) -> Built:
    torch.manual_seed(seed)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed + 1))
    return InplaceOnView().train(), (x,), lambda out: out.square().mean()


def instance_norm_leaky_relu(seed: int) -> Built:
    """Conv, InstanceNorm (its output is a view of a non-leaf), LeakyReLU(inplace=True)."""
    torch.manual_seed(seed)

    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1),
                             nn.InstanceNorm2d(c_out, affine=True), nn.LeakyReLU(inplace=True))

    model = nn.Sequential(block(1, 8), *(block(8, 8) for _ in range(5)), nn.Conv2d(8, 2, 1))
    x = torch.randn(4, 1, 32, 32, generator=torch.Generator().manual_seed(seed + 1))
    return model.train(), (x,), lambda out: out.square().mean()


class KeptIntermediates(nn.Module):
    """Each layer's output kept (detached) in a Python list until forward returns, as
    x-transformers keeps its layer intermediates; nothing reads them again."""

    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(),
                                                  nn.Dropout(0.1)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = []
        for layer in self.layers:
            x = layer(x)
            kept.append(x.detach() * 2)
        return x


def kept_intermediates(seed: int) -> Built:
    torch.manual_seed(seed)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed + 1))
    return KeptIntermediates().train(), (x,), lambda out: out.square().mean()


def transformer_encoder(seed: int) -> Built:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, dropout=0.1,
                                       batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).train()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(4, 64, 32, generator=g)
    padding = torch.zeros(4, 64, dtype=torch.bool)
    padding[1::2, 48:] = True
    return model, (x, None, padding), lambda out: out.square().mean()


class LSTMTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=3, dropout=0.1, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        y: torch.Tensor = self.head(out)
        return y


def lstm(seed: int) -> Built:
    torch.manual_seed(seed)
    x = torch.randn(8, 32, 32, generator=torch.Generator().manual_seed(seed + 1))
    return LSTMTagger().train(), (x,), lambda out: out.logsumexp(-1).mean()


class CellLoop(nn.Module):
    """A sequence classifier over a user's loop of ``nn.LSTMCell`` steps (the state passed
    back in as ``hx``), its head on the last step's hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(32, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[1], 64)
        state = (h, torch.zeros_like(h))
        for t in range(x.shape[0]):
            state = self.cell(x[t], hx=state)
        y: torch.Tensor = self.head(state[0])
        return y


def lstm_cell_loop(seed: int) -> Built:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(32, 8, 32, generator=g)
    targets = torch.randint(0, 10, (8,), generator=g)
    return CellLoop().train(), (x,), lambda out: F.cross_entropy(out, targets)


def conv_net(seed: int) -> Built:
    """Nested conv-BN-ReLU blocks, mean loss: the shape memplan handles today."""
    torch.manual_seed(seed)

    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out),
                             nn.ReLU())

    model = nn.Sequential(block(3, 16), *(block(16, 16) for _ in range(6)),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).train()
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(seed + 1))
    return model, (x,), lambda out: out.logsumexp(-1).mean()


LIB = "torch"
ENTRIES = [
    Entry("torch-flat-sequential", LIB, flat_sequential),
    Entry("torch-closure-loss", LIB, closure_loss),
    Entry("torch-inplace-view", LIB, inplace_on_view),
    Entry("torch-instancenorm-leakyrelu", LIB, instance_norm_leaky_relu),
    Entry("torch-transformer-encoder", LIB, transformer_encoder),
    Entry("torch-lstm", LIB, lstm),
    Entry("torch-lstmcell-loop", LIB, lstm_cell_loop),
    Entry("torch-kept-intermediates", LIB, kept_intermediates),
    Entry("torch-conv-net", LIB, conv_net),
]
