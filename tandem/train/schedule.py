"""Learning-rate schedule: linear warm-up, then cosine / linear / constant to a floor.

The effective peak LR follows the linear scaling rule (Goyal et al. 2017):
lr * global_batch / ref_batch (see ``tandem.core.validate.effective_lr``).

The position in the schedule is counted in steps of the configured global batch. While
the global batch is as configured that is the optimizer step itself. When an elastic
resize with ``elastic.on_resize = "scale_lr"`` changes the global batch by a ratio r
(new / configured), ``Schedule.resize`` re-anchors it: from that step on the position
advances by r per step and the LR is multiplied by r, so the LR as a function of
samples seen is the configured curve scaled by r (Goyal et al. define warm-up and
decay in epochs, i.e. samples, for the same reason). The anchor is part of the
scheduler's state_dict, so a later restart continues the same curve.
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: float, total: float, warmup: int, decay: str, floor: float) -> float:
    """Multiplier of the peak LR at schedule position ``step`` (0-based, configured-batch steps)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return floor + (1.0 - floor) * shape


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    def __init__(self, optim: torch.optim.Optimizer, total: int, warmup: int, decay: str, floor: float) -> None:
        self.horizon = total
        self.shape = (warmup, decay, floor)
        # Saved with the scheduler (LambdaLR saves every attribute): where the current segment
        # starts, and its batch ratio. The shape (horizon, warm-up, decay, floor) comes from the spec.
        self.anchor_step, self.anchor_pos, self.ratio = 0, 0, 1
        super().__init__(optim, lambda s: self.factor(s))

    def state_dict(self) -> dict:
        sd = super().state_dict()
        for k in ("horizon", "shape"):  # from the spec at every start (a longer resumed run keeps its own)
            sd.pop(k, None)
        return sd

    def position(self, step: int) -> float:
        """Schedule position of optimizer step ``step``, in configured-batch steps."""
        return self.anchor_pos + (step - self.anchor_step) * self.ratio

    def factor(self, step: int) -> float:
        return self.ratio * lr_factor(self.position(step), self.horizon, *self.shape)

    def resize(self, step: int, ratio: float, steps_left: int) -> None:
        """From optimizer step ``step`` on, the global batch is ``ratio`` x the configured one;
        ``steps_left`` steps remain. The LR of every group is set for that step now (the
        optimizer's saved LR belongs to the old ratio)."""
        self.anchor_pos, self.anchor_step, self.ratio = self.position(step), step, ratio
        self.horizon = self.anchor_pos + steps_left * ratio  # the decay ends with the run, as configured
        lrs = [base * self.factor(step) for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def make_scheduler(optim: torch.optim.Optimizer, total: int, warmup: int, decay: str, floor: float) -> Schedule:
    return Schedule(optim, total, warmup, decay, floor)
