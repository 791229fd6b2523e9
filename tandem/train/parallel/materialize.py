"""Build on the meta device, parallelize, then materialize each rank's shard (torchtitan's order).

    model = build_meta(spec.model, device)           # no storage: shapes only
    par = parallelize(model, spec, ctx, materialize=Materializer(seed, device))

``parallelize`` prunes the pipeline stages this rank does not own, turns parameters into tp
and FSDP2 DTensors (still on meta), then, before DDP (which broadcasts real values), calls the
materializer: ``to_empty`` allocates the local shards only, and each tensor is initialised
from its full value, computed on the CPU one tensor at a time from a generator seeded by
(seed, name) (``tandem/models/init.py``), of which the rank copies in the part it holds. A
single process runs the same per-tensor rules, so every strategy starts from the same weights
as one process does, and a rank's peak memory is its shard plus one full tensor.

A user's factory (``model.name = "pkg.module:factory"``) initialises its model its own way,
which tandem cannot replay per tensor: it is built on the CPU with the seeded global RNG, as
before, moved to the device and then sharded, so each rank briefly holds the whole model.

A model imported from a Hugging Face folder (``model.name = "hf:DIR"``) is filled the same way, each full
tensor read from the folder's safetensors through the adapter (``tandem/models/hf.py``) instead of drawn.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.core.hf import is_hf
from tandem.models import build_model
from tandem.models.init import full_value, named_tensors


def builtin(name: str) -> bool:
    """Models whose initialisation tandem replays per tensor (the built-in GPT and ResNets, and a Hugging
    Face folder's, whose tensors the materializer reads: ``weights_for``)."""
    return ":" not in name or is_hf(name)


def build_meta(model_spec, device: torch.device) -> nn.Module:
    """The spec's model with no storage (meta device) for built-in models; a user's factory's
    model built on the CPU (seed the RNG first) and moved to ``device``."""
    if builtin(model_spec.name):
        with torch.device("meta"):
            return build_model(model_spec)
    return build_model(model_spec).to(device)


def is_meta(model: nn.Module) -> bool:
    return any(_local(t).is_meta for t in list(model.parameters()) + list(model.buffers()))


class Materializer:
    """Callable on a (possibly pruned, tp- and FSDP-sharded) meta model: allocate and initialise."""

    def __init__(self, seed: int, device: torch.device, weights=None):
        self.seed, self.device, self.weights = seed, device, weights

    def __call__(self, model: nn.Module) -> None:
        materialize(model, self.device, self.seed, self.weights)


def materialize(model: nn.Module, device: torch.device, seed: int, weights=None) -> None:
    """Allocate ``model``'s meta tensors on ``device`` (local shards only) and give each the
    values its part of the full tensor has in a single process. A model with no meta tensor
    (a user's factory, built for real) is left as it is. ``weights``: a checkpoint's full tensors
    by name (``tandem.models.hf.Weights``) instead of the initial values."""
    if not is_meta(model):
        return
    ties = _ties(model)
    model.to_empty(device=device)
    for module, attr, first in ties:  # to_empty makes a new tensor per module: share them again
        module._parameters[attr] = first[0]._parameters[first[1]]
    with torch.no_grad():
        for name, module, attr, t in named_tensors(model):
            value = weights.value if weights is not None else full_value
            full = value(model, module, name, t.shape, t.dtype, seed)
            _copy_local(t, full)


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, tuple[nn.Module, str]]]:
    """(module, attribute, (module, attribute) of its first holder) of each shared parameter."""
    first: dict[int, tuple[nn.Module, str]] = {}
    out = []
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                out.append((module, attr, first[id(p)]))
            else:
                first[id(p)] = (module, attr)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _copy_local(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into ``t`` its part of ``full``: all of it, or a DTensor's local shard, cut by the
    same placements (tp's Shard, FSDP's Shard(0), both on a 2D mesh) without communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if not isinstance(t, DTensor):
        t.copy_(full)
        return
    full = full.to(t.to_local().device)
    part = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local()
    local = t.to_local()
    if part.shape != local.shape:
        raise RuntimeError(f"materialize: the local shard has shape {tuple(local.shape)}, the placements "
                           f"{t.placements} cut {tuple(part.shape)} from {tuple(full.shape)}")
    local.copy_(part)
