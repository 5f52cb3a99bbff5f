"""Small models for QAT demos and tests: fast on two CPU cores, every layer compressible."""

from __future__ import annotations

import torch
import torch.nn as nn


class SmallCNN(nn.Module):
    """conv-bn-relu-pool x2, then linear-relu-linear, for 1-channel square images.

    28x28 input: 16 and 32 channels (about 0.2 M parameters, fc1 holds most of them).
    `image_size` must be divisible by 4 (two 2x2 poolings).
    """

    def __init__(self, num_classes: int = 10, image_size: int = 28, channels=(16, 32), hidden: int = 128):
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image_size must be divisible by 4 (two 2x2 poolings), got {image_size}")
        c1, c2 = channels
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c2)
        self.pool = nn.MaxPool2d(2)
        self.act = nn.ReLU()
        side = image_size // 4
        self.fc1 = nn.Linear(c2 * side * side, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act(self.bn1(self.conv1(x))))
        x = self.pool(self.act(self.bn2(self.conv2(x))))
        x = self.act(self.fc1(x.flatten(1)))
        return self.fc2(x)
