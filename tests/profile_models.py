"""Models to profile with ``--model tests.profile_models:NAME``: factories of UserModel, small
enough for a test, shaped like the models whose memory people run short of."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradequiv.models import UserModel


class ConvBlock(nn.Module):
    """x + conv(relu(conv(relu(x)))): a residual block whose feature maps backward keeps."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


class ConvNet(nn.Module):
    def __init__(self, channels: int, depth: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)  # (B, C, H, W)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))  # (B, classes)


def conv_net(seed: int) -> UserModel:
    """Four residual conv blocks on 8 images of 3 x 12 x 12; each block a segment."""
    gen = torch.Generator().manual_seed(seed)
    model = ConvNet(channels=8, depth=4, classes=5)
    images = torch.randn(8, 3, 12, 12, generator=gen)
    labels = torch.randint(0, 5, (8,), generator=gen)
    return UserModel(model, (images,), labels, F.cross_entropy,
                     segments=[f"blocks.{i}" for i in range(4)])
