"""DDP communication hooks (gradient compression) and local SGD, with their bytes counted.

- ``fp16`` / ``bf16``: each bucket is cast to 16 bits, all-reduced, cast back (half the bytes;
  bf16 keeps fp32's range, fp16 its precision).
- ``powersgd``: each gradient matrix M (n x m) is sent as two rank-r factors P (n x r) and
  Q (m x r) with error feedback (Vogels et al. 2019); vectors (biases, norms) go
  uncompressed. Vanilla all-reduce runs for the first ``start`` steps (torch's minimum: 2).
- local SGD (``local_sgd_every = H``): after ``local_sgd_warmup`` plain DDP steps, ranks
  stop all-reducing gradients and instead average their parameters every H steps
  (torch's PostLocalSGDState + PeriodicModelAverager): about 1/H of DDP's bytes.

Every hook is wrapped so the bytes it actually hands to the process group are recorded
into the active ``comm.CommCounter`` (set ``TANDEM_COUNT_COMM=1`` to count plain DDP too).
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

from tandem.train.parallel import comm


def _bucket_bytes(bucket, itemsize: int | None = None) -> int:
    buf = bucket.buffer()
    return buf.numel() * (itemsize or buf.element_size())


def install(par, p) -> None:
    """Register the hook ``p.comm_hook`` (or local SGD) on the DDP model ``par.model``."""
    model = par.model
    group = par.dp_group()
    n = dist.get_world_size(group)
    if p.local_sgd_every:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        state = PostLocalSGDState(process_group=group, subgroup=None, start_localSGD_iter=p.local_sgd_warmup,
                                  post_local_gradient_allreduce=False)

        def local_sgd(state, bucket):
            if state.iter < state.start_localSGD_iter:
                comm.record("all_reduce", _bucket_bytes(bucket), n)
            return post_localSGD_hook(state, bucket)

        model.register_comm_hook(state, local_sgd)
        par.hook_state = state
        # parameters averaged every H steps with dist.all_reduce (counted by CommCounter's wrapper)
        par.averager = PeriodicModelAverager(period=p.local_sgd_every, warmup_steps=p.local_sgd_warmup,
                                             process_group=group)
        return
    hook = p.comm_hook
    if hook in ("fp16", "bf16"):
        inner = default_hooks.fp16_compress_hook if hook == "fp16" else default_hooks.bf16_compress_hook

        def compress(state, bucket):
            comm.record("all_reduce", _bucket_bytes(bucket, 2), n)
            return inner(state, bucket)

        model.register_comm_hook(group, compress)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=p.powersgd_rank,
                                   start_powerSGD_iter=2, min_compression_rate=1.0, warm_start=True,
                                   use_error_feedback=True, random_seed=0)

        def power(state, bucket):
            if state.iter < state.start_powerSGD_iter:  # vanilla all-reduce (not via dist.all_reduce)
                comm.record("all_reduce", _bucket_bytes(bucket), n)
            return psgd.powerSGD_hook(state, bucket)  # P and Q go through dist.all_reduce: counted there

        model.register_comm_hook(state, power)
        par.hook_state = state
    elif os.environ.get("TANDEM_COUNT_COMM") == "1":
        def plain(state, bucket):
            comm.record("all_reduce", _bucket_bytes(bucket), n)
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(group, plain)
