"""A user model for `model.name = "examples.tiny_models:mlp"`: any nn.Module factory works."""

from torch import nn


def mlp(num_classes: int = 10, in_channels: int = 1, hidden: int = 64, image_size: int = 8) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))
