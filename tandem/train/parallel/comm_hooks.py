"""DDP communication hooks (gradient compression) and local SGD, with their bytes counted.

- ``fp16`` / ``bf16``: each bucket is cast to 16 bits, all-reduced, cast back (half the bytes;
  bf16 keeps fp32's range, fp16 its precision).
- ``powersgd``: each gradient matrix M (n x m) is sent as two rank-r factors P (n x r) and
  Q (m x r) with error feedback (Vogels et al. 2019); vectors (biases, norms) go
  uncompressed. Vanilla all-reduce runs for the first ``start`` steps (torch's minimum: 2).
- local SGD (``local_sgd_every = H``): after ``local_sgd_warmup`` plain DDP steps, ranks
  stop all-reducing gradients and instead average their parameters every H steps
  (torch's PostLocalSGDState + PeriodicModelAverager): about 1/H of DDP's bytes.

The bytes each hook hands to the process group reach the active ``comm.CommCounter``: the
fp16/bf16 hooks' 16-bit functional all-reduce through its dispatch mode; PowerSGD, local SGD and the plain all-reduce hook (installed with
``TANDEM_COUNT_COMM=1`` so plain DDP is counted too) call ``dist.all_reduce``, which the counter wraps.
"""

from __future__ import annotations

import os

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook


def install(par, p) -> None:
    """Register the hook ``p.comm_hook`` (or local SGD) on the DDP model ``par.model``."""
    model = par.model
    group = par.dp_group()
    if p.local_sgd_every:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        state = PostLocalSGDState(process_group=group, subgroup=None, start_localSGD_iter=p.local_sgd_warmup,
                                  post_local_gradient_allreduce=False)
        model.register_comm_hook(state, post_localSGD_hook)  # warm-up all-reduce: dist.all_reduce, counted
        par.hook_state = state
        # parameters averaged every H steps with dist.all_reduce (counted by CommCounter's wrapper)
        par.averager = PeriodicModelAverager(period=p.local_sgd_every, warmup_steps=p.local_sgd_warmup,
                                             process_group=group)
        return
    hook = p.comm_hook
    if hook in ("fp16", "bf16"):
        inner = default_hooks.fp16_compress_hook if hook == "fp16" else default_hooks.bf16_compress_hook

        def compress(state, bucket):   # a wrapper: DDP refuses torch's own bf16 hook object off NCCL
            return inner(state, bucket)   # 16-bit functional all-reduce: seen by CommCounter's dispatch mode

        model.register_comm_hook(group, compress)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=p.powersgd_rank,
                                   start_powerSGD_iter=2, min_compression_rate=1.0, warm_start=True,
                                   use_error_feedback=True, random_seed=0)

        # vanilla all-reduce before start, then P, Q and the uncompressed vectors: all via dist.all_reduce
        model.register_comm_hook(state, psgd.powerSGD_hook)
        par.hook_state = state
    elif os.environ.get("TANDEM_COUNT_COMM") == "1":  # the Python all-reduce hook: dist.all_reduce, counted
        model.register_comm_hook(group, default_hooks.allreduce_hook)
