"""CIFAR-style ResNets (He et al. 2016, section 4.2) with BatchNorm, built in for the command line.

``resnet(20)`` is ResNet-20: a 3x3 stem convolution, three stages of ``(depth - 2) / 6`` post-activation
basic blocks with 16, 32 and 64 channels (times ``width``), stride 2 at the start of stages 2 and 3, where a
1x1 convolution with BatchNorm projects the shortcut, global average pooling and a Linear classifier:
about 0.27M parameters for ``width=1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``; the shortcut is a 1x1 conv + BN when shapes change."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet: input ``(N, in_channels, H, W)`` (32x32 in the paper), output ``(N, classes)`` logits."""

    def __init__(self, depth: int = 20, width: int = 1, classes: int = 10, in_channels: int = 3):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"a CIFAR ResNet has depth 6n + 2 (20, 32, 44, 56, 110), got {depth}")
        if width < 1 or classes < 1 or in_channels < 1:
            raise ValueError("width, classes and in_channels must be positive")
        blocks = (depth - 2) // 6
        widths = [16 * width, 32 * width, 64 * width]
        self.conv = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        stages, cin = [], widths[0]
        for i, cout in enumerate(widths):
            stage = []
            for b in range(blocks):
                stage.append(BasicBlock(cin, cout, 2 if (i > 0 and b == 0) else 1))
                cin = cout
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(widths[-1], classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet(depth: int = 20, width: int = 1, classes: int = 10, in_channels: int = 3) -> ResNet:
    """A CIFAR-style ResNet-``depth`` with BatchNorm (see `ResNet`)."""
    return ResNet(depth, width, classes, in_channels)
