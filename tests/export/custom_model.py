"""A user's own model for the export tests (``model.name = "export.custom_model:build"``): a convolution,
BatchNorm statistics with their integer counter, and a non-persistent buffer (never in a state dict)."""

import torch
from torch import nn


class Small(nn.Module):
    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, num_classes)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3))) * self.scale


def build(num_classes=10, in_channels=3):
    return Small(num_classes, in_channels)
