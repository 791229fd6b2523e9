"""Replicated data parallelism: DDP, ZeRO-1, and gradient all-reduce over tp/pp slices.

- ``ddp``: torch's DistributedDataParallel (bucketed all-reduce overlapped with backward).
- ``zero1``: DDP for the gradients plus ``ZeroRedundancyOptimizer`` (built by tandem/train/optim.py):
  each rank keeps the optimizer state of 1/dp of the parameters, steps them, and broadcasts its slice back.
- With tp or pp, DDP cannot wrap DTensors or pipeline stages; ``GradSync`` all-reduces every
  gradient (the local shard of a DTensor) over the dp group once per step, flattened into
  buckets, and divides by dp (the same mean DDP computes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tandem.train.rng import rng_state, set_rng_state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GradSync:
    """Mean of the gradients over a dp process group, bucketed (``bucket_mb`` MiB per all-reduce)."""

    def __init__(self, params, group, size: int, bucket_mb: float = 25.0):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.size = group, size
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)

    @torch.no_grad()
    def __call__(self) -> None:
        if self.size <= 1:
            return
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        bucket, nbytes = [], 0
        for g in grads + [None]:
            if g is not None:
                bucket.append(g)
                nbytes += g.numel() * g.element_size()
            if bucket and (g is None or nbytes >= self.bucket_bytes):
                by_dtype: dict = {}
                for t in bucket:
                    by_dtype.setdefault(t.dtype, []).append(t)
                for ts in by_dtype.values():
                    flat = torch.cat([t.reshape(-1) for t in ts])
                    dist.all_reduce(flat, group=self.group)
                    flat /= self.size
                    off = 0
                    for t in ts:
                        t.copy_(flat[off:off + t.numel()].view_as(t))
                        off += t.numel()
                bucket, nbytes = [], 0


def wrap_ddp(model: nn.Module, p, device: torch.device, group=None) -> nn.Module:
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group,
        bucket_cap_mb=p.bucket_cap_mb, gradient_as_bucket_view=p.gradient_as_bucket_view,
        static_graph=p.static_graph, find_unused_parameters=p.find_unused_parameters)


def prime_buckets(stepper, dataset, micro_batch: int, fmt, device: torch.device) -> None:
    """Before a resumed run loads its checkpoint: make DDP reduce its first step as the uninterrupted run did.

    DDP's first backward reduces every gradient in one bucket (reverse parameter order) and records the
    order they became ready in; from the next forward on it uses buckets in that order. With more than two
    ranks, gloo's ring all-reduce sums an element in an order set by its offset in the bucket, so a resumed
    run's first step would differ from the uninterrupted run's in the last bits of some gradients (bf16's
    rounding hides it for a few steps, then the runs drift apart). One synced backward of a real batch, its
    gradients dropped and buffers and RNG put back, makes DDP rebuild its buckets as the uninterrupted run
    did. Skipped under a stateful comm hook (PowerSGD, local SGD), whose state the backward would advance.
    """
    par = stepper.par
    model = par.model
    if not isinstance(model, nn.parallel.DistributedDataParallel) or par.hook_state is not None:
        return
    from torch.utils.data import default_collate

    rng, buffers = rng_state(), [b.detach().clone() for b in model.buffers()]
    x, y = (t.to(device) for t in default_collate([dataset[i] for i in range(min(micro_batch, len(dataset)))]))
    stepper.forward_backward_step(x.contiguous(memory_format=fmt) if x.dim() == 4 else x, y, len(y))
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    for p in model.parameters():
        p.grad = None
    set_rng_state(rng)
