"""Models the tests build beside memplan's own: a U-Net (long skips) and its loss."""

from __future__ import annotations

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
