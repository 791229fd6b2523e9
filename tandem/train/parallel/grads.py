"""Gradients across shards and stages: fp16 loss scaling and the global gradient norm.

- ``DistGradScaler``: torch's ``GradScaler`` unscaling each rank's *local* gradients (the local
  shard of a DTensor under FSDP2 / tp, the stage's own under pp) and OR-ing the inf/NaN check over
  every rank of the job, so all shards and all pipeline stages skip an overflowing step together
  and halve the scale together (torch's ``ShardedGradScaler`` does the same for FSDP, but needs a
  process group even for one rank, and hands DTensors to the foreach kernel).
- ``global_grad_norm``: the 2-norm of the whole model's gradient, whatever holds it: DTensor
  gradients (FSDP2 shards, tp shards, both on a 2-D mesh) through torch's ``get_total_norm`` and
  ``full_tensor``; plain tensors directly; the per-stage results summed over the pp group.
  Replicated gradients (DDP, ZeRO-1, tp's replicated norms, the dp copies after ``GradSync``) are
  identical on their ranks and counted once. ZeRO-1 shards optimizer state, not gradients.
- ``clip_grads_``: torch's formula (scale by max_norm / (norm + 1e-6) when above max_norm) applied
  to the local tensors.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DistGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf check spans the job (``group``: None = the world)."""

    def __init__(self, device: str, group=None, **kw) -> None:
        super().__init__(device, **kw)
        self.group = group

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        by_kind: dict = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = _local(p.grad)  # a view of the DTensor's shard: unscaled in place
                        by_kind[(g.device, g.dtype)].append(g)
            for (device, _), grads in by_kind.items():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf.to(device),
                                                                 inv_scale.to(device))
        return {found_inf.device: found_inf}

    def unscale_(self, optimizer) -> None:
        super().unscale_(optimizer)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)

    def found_inf(self, optimizer) -> bool:
        """After ``unscale_``: whether this step overflowed somewhere (the same answer on every rank)."""
        st = self._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})
        return any(float(v) > 0 for v in st.values())


def grad_scaler(device: torch.device, dtype: str) -> DistGradScaler | None:
    """fp16 needs loss scaling; bf16 and fp32 do not (None)."""
    return DistGradScaler(device.type) if dtype == "fp16" else None


def _grads(params) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if p.grad is not None and id(p) not in seen:  # tied weights: one gradient
            seen.add(id(p))
            out.append(p.grad)
    return out


@torch.no_grad()
def global_grad_norm(params, pp_group=None) -> torch.Tensor:
    """2-norm of all gradients of the model (fp32, a plain scalar tensor, the same on every rank)."""
    groups: dict = defaultdict(list)  # DTensors of one mesh and layout reduce together
    for g in _grads(params):
        key = (id(g.device_mesh), g.placements) if isinstance(g, DTensor) else None
        groups[key].append(g)
    device = next(iter(groups.values()))[0].device if groups else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        n = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq = sq + n.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:  # each stage holds its own layers
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


@torch.no_grad()
def clip_grads_(params, max_norm: float, total_norm: torch.Tensor) -> None:
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [_local(g) for g in _grads(params)]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
