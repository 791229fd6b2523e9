"""The runtime, as a library for your own script (and the engine of `tandem train`).

    from tandem.train import runtime
    ctx = runtime.init()                                  # process group, device, threads
    model = runtime.wrap_ddp(model.to(ctx.device), ctx, ParallelSpec(bucket_cap_mb=50))
    sampler = ResumableDistributedSampler(dataset, ctx.world, ctx.rank, seed=0)
    with runtime.autocast(ctx, "bf16"): loss = ...

Run the script with `tandem launch` (or torchrun): the rank comes from the environment.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tandem.core.environment import ClusterEnv, resolve_device
from tandem.core.errors import ConfigError
from tandem.core.spec import ParallelSpec
from tandem.core.teardown import BARRIER_TIMEOUT_S, DRAIN_S, close_process_group
from tandem.train.rng import rng_state, seed_everything, set_rng_state  # noqa: F401 (this library's face too)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device: str | None = None, backend: str | None = None) -> DistContext:
    """Join the process group the launcher set up (or a world of one without a launcher)."""
    device, backend = resolve_device(device, backend, os.environ)
    env = ClusterEnv.detect()
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
        dev = torch.device("cuda", env.local_rank)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if env.distributed and not dist.is_initialized():
        dist.init_process_group(backend, device_id=dev if device == "cuda" else None)
    return DistContext(rank=env.rank, world=env.world, local_rank=env.local_rank, local_world=env.local_world,
                       node=env.node, device=dev, backend=backend)


def shutdown(ok: bool = True, timeout_s: float = BARRIER_TIMEOUT_S, drain_s: float = DRAIN_S) -> None:
    """Leave the process group. ``ok``: this rank succeeded, so wait (up to ``timeout_s``) for the
    others before closing; pass ``ok=False`` from a failure path, which must not wait on dead peers
    (tandem/core/teardown.py says why a successful run waits)."""
    close_process_group(ok, timeout_s, drain_s)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def convert_sync_bn(model: nn.Module, ctx: DistContext) -> nn.Module:
    if ctx.device.type != "cuda":
        raise ConfigError("torch's SyncBatchNorm runs only on GPUs", field="model.sync_bn", value=True,
                          fix="set model.sync_bn=false on CPU (each rank keeps its own BatchNorm statistics)")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def wrap_ddp(model: nn.Module, ctx: DistContext, p: ParallelSpec | None = None) -> nn.Module:
    """DistributedDataParallel with the knobs that matter for speed exposed (a world of one: unchanged)."""
    if ctx.world == 1 or not dist.is_initialized():
        return model
    # the one DDP wrapper, parallelize()'s too; deferred: tandem.train.parallel imports torch.distributed.tensor
    # (~2 s), which a script that never wraps a model should not pay
    from tandem.train.parallel.ddp import wrap_ddp as wrap

    return wrap(model, p or ParallelSpec(), ctx.device)


def sync_buffers(model: nn.Module, ctx: DistContext) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats), as DDP does before each forward.

    Between forwards the ranks' running stats differ; checkpoints and evaluation must
    use one copy, the one training will continue from.
    """
    if dist.is_initialized() and ctx.world > 1:
        for b in model.buffers():
            dist.broadcast(b.data, src=0)


def no_sync(model: nn.Module, skip: bool):
    """Skip DDP's all-reduce on accumulation micro-steps: gradients only sync on the last one."""
    if skip and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return nullcontext()


def autocast(ctx: DistContext, dtype: str):
    if dtype == "fp32":
        return nullcontext()
    return torch.autocast(ctx.device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


def grad_scaler(ctx: DistContext, dtype: str):
    """fp16 needs loss scaling (a GradScaler whose overflow check spans every rank); bf16 and fp32 do not."""
    from tandem.train.parallel.grads import grad_scaler as make  # deferred as in wrap_ddp

    return make(ctx.device, dtype)


def all_reduce_sum(values: list[float], ctx: DistContext, group=None) -> list[float]:
    """``values`` summed over ``group`` (every rank when None)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if dist.is_initialized() and ctx.world > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


class PendingSum:
    """An all-reduce (sum) started now and read later, so that the next step's compute hides
    its latency instead of every rank waiting for it (and for the slowest peer) at each step."""

    def __init__(self, values: list[float], ctx: DistContext) -> None:
        self.t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
        self.work = dist.all_reduce(self.t, async_op=True) if dist.is_initialized() and ctx.world > 1 else None

    def result(self) -> list[float]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.t.tolist()
