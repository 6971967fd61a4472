"""The paper's deep residual network (Sec. 5.2), in plain PyTorch.

Bottleneck units built from conv-bn-relu "layers" (the paper's footnote: "we count a
conv-bn-relu as one layer"), as in the MXNet memonger example the paper measured: depth =
3 * (number of units) + 1 (the stem convolution); projection shortcuts are conv-bn.
"""

from __future__ import annotations

import torch
from torch import nn

_STAGE_WIDTHS = (256, 512, 1024, 2048)  # output channels per stage; a unit's middle is 1/4 of it
_BASE_WIDTH = 64


def units_for_depth(depth: int) -> tuple[int, int, int, int]:
    """Units per stage for a given depth.

    Standard depths keep their published layout; deeper ones keep stages 1, 2, 4 at 3, 24, 3
    units and put the rest in stage 3, as MXNet's memonger example does (1000 -> 3, 24, 303, 3).
    """
    standard = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3), 200: (3, 24, 36, 3)}
    if depth in standard:
        return standard[depth]
    total = (depth - 1) // 3
    if total < 3 + 24 + 1 + 3:
        # Too shallow for the deep layout: spread the units like ResNet-50 does, at least one each.
        base = max(1, total // 4)
        rest = total - 3 * base
        return (base, base, max(1, rest), base)
    return (3, 24, total - 30, 3)


class Bottleneck(nn.Module):
    """conv1x1-bn-relu -> conv3x3-bn-relu -> conv1x1-bn, plus the shortcut, then relu."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, dropout: float) -> None:
        super().__init__()
        mid = out_ch // 4
        self.conv1 = nn.Conv2d(in_ch, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.relu2 = nn.ReLU()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv3 = nn.Conv2d(mid, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )
        self.relu3 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.dropout(self.relu2(self.bn2(self.conv2(out))))
        out = self.bn3(self.conv3(out))
        result: torch.Tensor = self.relu3(out + self.shortcut(x))
        return result


class ResNet(nn.Module):
    def __init__(
        self,
        depth: int = 50,
        num_classes: int = 1000,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.depth = depth
        self.units = units_for_depth(depth)
        self.stem = nn.Sequential(
            nn.Conv2d(3, _BASE_WIDTH, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(_BASE_WIDTH),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_ch = _BASE_WIDTH
        for i, (n_units, out_ch) in enumerate(zip(self.units, _STAGE_WIDTHS)):
            blocks = []
            for j in range(n_units):
                stride = 2 if (j == 0 and i > 0) else 1
                blocks.append(Bottleneck(in_ch, out_ch, stride, dropout))
                in_ch = out_ch
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(in_ch, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.stages(self.stem(x)))
        return logits
