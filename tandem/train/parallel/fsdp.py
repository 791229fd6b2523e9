"""ZeRO-2, ZeRO-3 and HSDP on FSDP2 (``fully_shard``), one unit per block plus the root.

- zero3 / fsdp: parameters, gradients and optimizer state sharded over the dp ranks; each
  block's parameters are all-gathered before its forward and again before its backward
  (``reshard_after_forward=True``), gradients reduce-scattered.
- zero2: the same shards at rest, but a block keeps its gathered parameters from forward to
  backward (``reshard_after_forward=False``): one all-gather per step instead of two, more
  memory during the step.
- hsdp: a 2D mesh (dp_replicate, dp_shard): sharded inside a node, shards all-reduced
  across nodes.
Mixed precision stays with autocast (parameters and reductions in fp32), exactly as the
single-process and DDP paths run, so the numerics tests compare like with like.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units: a decoder's blocks (its ``layout``), or ResNet residual blocks."""
    lay = getattr(model, "layout", None)
    if lay is not None:
        return list(getattr(model, lay.blocks).values())
    if isinstance(getattr(model, "layers", None), nn.ModuleDict):   # a user's model laid out the same way
        return list(model.layers.values())
    out = []
    for name in ("layer1", "layer2", "layer3", "layer4"):
        if isinstance(getattr(model, name, None), nn.Sequential):
            out.extend(getattr(model, name))
    return out


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, strategy: str) -> nn.Module:
    """``mesh``: the 1D dp mesh, or the 2D (dp_replicate, dp_shard) mesh for hsdp."""
    reshard = strategy != "zero2"
    for block in blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model
