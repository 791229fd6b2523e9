"""The training loss, as a *sum* over the micro-batch's scored targets.

The trainer divides that sum by the number of scored targets of the whole optimizer step on this
rank (every micro-batch, every accumulation step), so the gradient is the exact mean over the
step's samples, whatever the micro-batch split, the accumulation or the length of the last step
of an epoch. ``model.loss`` picks where the sum comes from:

- ``cross_entropy`` (default): the built-in summed cross-entropy over class labels (N,) or token
  targets (N, T), targets equal to -100 left out.
- ``model``: the model computes it: the trainer calls ``model(x, y)`` (and ``model(x)`` for the held-out
  evaluation, which then returns logits), which returns the loss as a
  tensor, a dict with ``"loss"`` or an object with ``.loss`` (Hugging Face's output classes). Such a
  loss is taken as a *mean* over the micro-batch's scored targets (Hugging Face's convention) and
  multiplied by their count: the targets of ``y`` that are not -100 (for class labels, len(y)). A
  model that shifts its labels internally scores one target fewer per sequence: give it targets
  already shifted, or name a loss function instead.
- ``pkg.module:fn``: ``fn(output, target) -> tensor``, the *sum* over the micro-batch (for example
  ``F.cross_entropy(..., reduction="sum")``); it also runs as the pipeline schedule's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tandem.core.factory import import_factory
from tandem.train.parallel import loss_sum
from tandem.train.tasks import IGNORE

BUILTIN = "cross_entropy"
MODEL = "model"
VALID = f"{BUILTIN} | {MODEL} | an import path 'pkg.module:fn' returning the summed loss"


def scored(y: torch.Tensor) -> int:
    """Targets of ``y`` that count: not -100 (token targets), or one per sample (class labels)."""
    return int((y != IGNORE).sum()) if y.dim() > 1 else len(y)


def returned_loss(out) -> torch.Tensor:
    if isinstance(out, dict):
        return out["loss"]
    return out if isinstance(out, torch.Tensor) else out.loss


@dataclass(frozen=True)
class Loss:
    """``fn(output, target) -> summed loss``; None: the model returns its (mean) loss."""

    fn: Callable | None = loss_sum

    def __call__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.fn is None:
            return returned_loss(model(x, y)) * scored(y)
        return self.fn(model(x), y)


def resolve_loss(name: str) -> Loss:
    """The spec's ``model.loss``; a bad import path is a one-line ConfigError."""
    if name in ("", BUILTIN):
        return Loss()
    if name == MODEL:
        return Loss(None)
    return Loss(import_factory(name, field="model.loss", valid=VALID))
