"""Learning-rate schedule: linear warm-up, then cosine / linear / constant to a floor.

The effective peak LR follows the linear scaling rule (Goyal et al. 2017):
lr * global_batch / ref_batch (see ``tandem.core.validate.effective_lr``).
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total: int, warmup: int, decay: str, floor: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return floor + (1.0 - floor) * shape


def make_scheduler(optim: torch.optim.Optimizer, total: int, warmup: int, decay: str, floor: float):
    return torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(s, total, warmup, decay, floor))
