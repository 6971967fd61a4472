"""Models the tests build beside memplan's own: a U-Net (long skips) and its loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _block(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class UNet(nn.Module):
    """Encoder outputs skip to the decoder: every cut inside carries them (long skips)."""

    def __init__(self, width: int = 4, levels: int = 3) -> None:
        super().__init__()
        ch = [width * 2**i for i in range(levels + 1)]
        self.down = nn.ModuleList([_block(3 if i == 0 else ch[i - 1], ch[i])
                                   for i in range(levels)])
        self.mid = _block(ch[levels - 1], ch[levels])
        self.up = nn.ModuleList([_block(ch[i + 1] + ch[i], ch[i]) for i in reversed(range(levels))])
        self.head = nn.Conv2d(ch[0], 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, down in enumerate(self.down):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        x = self.mid(F.max_pool2d(x, 2))
        for up in self.up:
            x = up(torch.cat([F.interpolate(x, scale_factor=2.0), skips.pop()], 1))
        out: torch.Tensor = self.head(x)
        return out


def unet_inputs() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return UNet(), torch.randn(2, 3, 32, 32)


def unet_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


class RopeLayer(nn.Module):
    """A pre-norm decoder layer reading rotary tables and a mask made once by its model."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d),
                                 nn.Dropout(0.1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(d, dim=2))
        q, k = (z * cos + torch.cat([-z[..., z.shape[-1] // 2:], z[..., : z.shape[-1] // 2]],
                                    -1) * sin for z in (q, k))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5 + mask
        y = F.dropout(scores.softmax(-1), 0.1, self.training) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class RopeDecoder(nn.Module):
    """Like HF Llama: rotary cos/sin and a materialised attention mask made before the first
    layer and read by every layer (shared values)."""

    def __init__(self, layers: int = 4, d: int = 32, heads: int = 2, vocab: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(RopeLayer(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        half = d // heads // 2
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(half) / half),
                             persistent=False)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        angles = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        causal = torch.full((t, t), float("-inf")).triu(1)
        mask = causal + (1.0 - attention_mask[:, None, None, :].float()) * -1e9
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def rope_inputs() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    return RopeDecoder(), ids, mask


def rope_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().logsumexp(-1).mean()


def flat_mlp(blocks: int = 8, d: int = 32, nested: bool = False) -> nn.Sequential:
    """blocks x (Linear, BatchNorm1d, GELU, Dropout): in one flat Sequential, or one Sequential
    per block (``nested``)."""
    torch.manual_seed(0)
    layers = [[nn.Linear(d, d), nn.BatchNorm1d(d), nn.GELU(), nn.Dropout(0.1)]
              for _ in range(blocks)]
    if nested:
        return nn.Sequential(*[nn.Sequential(*b) for b in layers])
    return nn.Sequential(*[m for b in layers for m in b])


class FunctionalMLP(nn.Module):
    """An MLP in functional code: parameters only, no submodules."""

    def __init__(self, n: int = 6, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.ParameterList([nn.Parameter(torch.randn(d, d) / d**0.5) for _ in range(n)])
        self.b = nn.ParameterList([nn.Parameter(torch.zeros(d)) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, b in zip(self.w, self.b):
            x = F.dropout(F.gelu(F.layer_norm(x @ w + b, x.shape[-1:])), 0.1, self.training)
        return x


class StackedCellLoop(nn.Module):
    """The paper's LSTM as users write it, small: a loop over ``nn.LSTMCell`` layers with a
    per-step loss, no module per step (its cuts are leaf-call ends and op boundaries)."""

    def __init__(self, layers: int = 2, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cells = nn.ModuleList(nn.LSTMCell(width, width) for _ in range(layers))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        zeros = x.new_zeros(x.shape[1], x.shape[2])
        state = [(zeros, zeros) for _ in self.cells]
        loss = x.new_zeros(())
        for t in range(x.shape[0]):
            h = x[t]
            for i, cell in enumerate(self.cells):
                state[i] = cell(h, state[i])
                h = state[i][0]
            loss = loss + F.cross_entropy(self.out(h), y[t], reduction="sum")
        return loss


def cell_loop_inputs(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(steps, 3, 8), torch.randint(0, 5, (steps, 3))


def mlp_input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(64, 32)


def square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


class _TanhGelu(torch.autograd.Function):
    """A hand-written GELU as HF Bloom writes its own (``GeLUFunction``): the forward's ops
    run without autograd and ``ctx.save_for_backward`` keeps the input for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        dt = 0.79788456 * (1 + 0.134145 * x * x) * (1 - t * t)
        return grad * (0.5 * (1 + t) + 0.5 * x * dt)


class CustomFunctionMLP(nn.Module):
    """Blocks of Linear -> a custom autograd.Function -> Linear, with residuals."""

    def __init__(self, n: int = 6, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.ModuleList([nn.Linear(d, 4 * d) for _ in range(n)])
        self.down = nn.ModuleList([nn.Linear(4 * d, d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down):
            x = x + down(_TanhGelu.apply(up(x)))
        return x
