"""A small digits classifier whose forward sleeps on one rank: a straggler in the forward section.

    model.name = "diagnose.slow_model:factory"   SLOW_FORWARD_RANK=1 SLOW_FORWARD_MS=80
"""

import os
import time

from torch import nn


class SlowForward(nn.Module):
    def __init__(self, num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(8 * 8 * 8, num_classes))
        slow = os.environ.get("SLOW_FORWARD_RANK")
        self.sleep_s = (float(os.environ.get("SLOW_FORWARD_MS", "0")) / 1000
                        if slow is not None and slow == os.environ.get("RANK") else 0.0)

    def forward(self, x):
        if self.sleep_s and self.training:
            time.sleep(self.sleep_s)
        return self.net(x)


def factory(num_classes: int, in_channels: int) -> nn.Module:
    return SlowForward(num_classes, in_channels)
