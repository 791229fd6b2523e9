"""The training loss, as a *sum* over the micro-batch's scored targets.

The trainer divides that sum by the number of scored targets of the whole optimizer step on this
rank (every micro-batch, every accumulation step), so the gradient is the exact mean over the
step's samples, whatever the micro-batch split, the accumulation or the length of the last step
of an epoch. ``model.loss`` picks where the sum comes from:

- ``cross_entropy`` (default): the built-in summed cross-entropy over class labels (N,) or token
  targets (N, T), targets equal to -100 left out.
- ``model``: the model computes it, called in one of two ways (decided from its forward's signature):

  * a forward that names ``input_ids`` and ``labels`` (a ``transformers`` model, or one written in its
    manner) gets keywords in Hugging Face's convention: ``input_ids=x`` and ``labels`` aligned with
    ``input_ids``, which the model shifts itself (position t's logits predict ``labels[t + 1]``).
    tandem's token targets are already shifted (``y[t] = x[t + 1]``), so the labels passed are
    ``[-100, y[0], ..., y[T-2]]``: after the model's shift, position t is scored against ``y[t]``, the
    same next-token loss as ``cross_entropy``. That shift drops the window's last target; where the
    model is a ``transformers`` causal LM whose loss takes ``shift_labels`` (its signature says so;
    transformers 5 does), ``y`` goes in as ``shift_labels`` too and every one of the T targets is
    scored: exactly ``cross_entropy``'s loss. Class labels (``y`` of shape (N,)) go in as ``labels=y`` unshifted.
  * any other forward: ``model(x, y)``, positionally, for a model that scores ``y`` as given.

  The held-out evaluation calls ``model(x)`` (its logits: a tensor, or ``.logits``). The returned
  loss is a tensor, a dict with ``"loss"`` or an object with ``.loss`` (Hugging Face's output
  classes), taken as a *mean* over the targets it scored (Hugging Face's convention) and multiplied
  by their count: the targets that are not -100 (for class labels, len(y)).
- ``pkg.module:fn``: ``fn(output, target) -> tensor``, the *sum* over the micro-batch (for example
  ``F.cross_entropy(..., reduction="sum")``); it also runs as the pipeline schedule's loss.

A mixture of experts (``model.experts``) adds its router losses (load balance, z-loss) to the built-in
and the ``pkg.module:fn`` sums, times the micro-batch's scored targets: after the division by the step's
targets they are the step's token-weighted mean, the same on any data-parallel split.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.core.factory import import_factory
from tandem.models.moe import add_router_loss, router_loss
from tandem.models.output import logits_of
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


def call_style(model: torch.nn.Module) -> str:
    """How loss = "model" calls ``model``: "hf_shift" (input_ids=, labels=, shift_labels=), "hf"
    (input_ids=, labels=) or "positional" (model(x, y)); from its forward's signature (under DDP: the
    wrapped module's), decided once per model."""
    inner = getattr(model, "module", model)
    style = _STYLES.get(inner)
    if style is None:
        style = _style(type(inner))
        if style == "hf_shift" and not _causal_lm_loss(inner):
            style = "hf"  # a transformers model whose loss is not the causal LM's: shift_labels means nothing to it
        _STYLES[inner] = style
    return style


_STYLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def _style(cls: type) -> str:  # per class, from the signature
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "positional"
    if "input_ids" not in params or "labels" not in params:
        return "positional"
    takes_kwargs = "shift_labels" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return "hf_shift" if takes_kwargs and _is_transformers(cls) and _loss_takes_shift_labels() else "hf"


def _is_transformers(cls: type) -> bool:
    return any(c.__module__.startswith("transformers.") for c in cls.__mro__)


def _causal_lm_loss(model: torch.nn.Module) -> bool:
    """The model's loss is transformers' causal-LM loss, the one that reads ``shift_labels``."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    try:
        return getattr(model, "loss_function", None) is ForCausalLMLoss
    except Exception:  # a property that cannot resolve the model's loss type
        return False


@functools.lru_cache(maxsize=None)
def _loss_takes_shift_labels() -> bool:
    """transformers' causal-LM loss reads ``shift_labels`` (the targets as given, no shift) from the
    forward's keywords; earlier versions do not, and would shift ``labels`` themselves."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    return "shift_labels" in inspect.signature(ForCausalLMLoss).parameters


def hf_labels(y: torch.Tensor) -> torch.Tensor:
    """Token targets ``y`` (already shifted: y[t] = x[t+1]) as labels aligned with the input, which a
    Hugging Face causal LM shifts itself: ``[-100, y[0], ..., y[T-2]]``."""
    return torch.cat([torch.full_like(y[:, :1], IGNORE), y[:, :-1]], dim=1)


def call_model_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed loss of loss = "model": the model's mean times the targets it scored."""
    style = call_style(model)
    if style == "positional":
        return returned_loss(model(x, y)) * scored(y)
    if y.dim() < 2:  # class labels: nothing to shift
        return returned_loss(model(input_ids=x, labels=y)) * scored(y)
    labels = hf_labels(y)
    if style == "hf_shift":
        return returned_loss(model(input_ids=x, labels=labels, shift_labels=y.contiguous())) * scored(y)
    return returned_loss(model(input_ids=x, labels=labels)) * scored(labels)


@dataclass(frozen=True)
class Loss:
    """``fn(output, target) -> summed loss``; None: the model returns its (mean) loss."""

    fn: Callable | None = loss_sum

    def __call__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.fn is None:
            return call_model_loss(model, x, y)
        loss = self.fn(logits_of(model(x)), y)
        aux = router_loss(model)   # a mixture of experts' router losses (tandem/models/moe.py), a mean per
        # micro-batch: weighted by its scored targets so that the trainer's / denom makes it the step's mean
        return loss if aux is None else add_router_loss(loss, aux * scored(y))


def resolve_loss(name: str) -> Loss:
    """The spec's ``model.loss``; a bad import path is a one-line ConfigError."""
    if name in ("", BUILTIN):
        return Loss()
    if name == MODEL:
        return Loss(None)
    return Loss(import_factory(name, field="model.loss", valid=VALID))
