"""FSDP's own memory traffic: the copies and divisions each implementation runs on every unsharded parameter and
gradient of every micro-batch, timed at the memory bandwidth (bandwidth_bound.BANDWIDTH_SHARE).

Both implementations move the gathered parameters and the unsharded gradients through extra kernels besides the
collectives; which ones, and on which stream, differs (read in torch 2.13's source, torch/distributed/fsdp/):

- ``fsdp1`` (FullyShardedDataParallel, one FlatParameter per unit). The all-gather writes straight into the
  unsharded flat parameter, so forward copies nothing. The module's parameters are views made by ``torch.split``
  of the flat parameter under autograd (_flat_param.py, ``_get_unflat_views_unaligned`` called from
  ``_use_unsharded_views`` with grad enabled), so backward assembles the flat gradient from the views' gradients
  (split's backward is a concatenation): read and write of every unsharded gradient element, on the compute
  stream. The post-backward hook then casts it to the reduce dtype if that differs, and divides it in place by the
  pre-divide factor before the reduce-scatter (_runtime_utils.py ``_reduce_grad``: ``_div_if_needed(
  padded_unsharded_grad, _gradient_predivide_factor)``; the factor, _init_utils.py with default_hooks.py, is the
  largest power of two f with world % f == 0 and world / f > f, so it is > 1 for any world of 2 or more, HSDP
  counting shard x replica): a read and a write of every element on the post-backward stream, ahead of the
  reduce-scatter on that stream.
- ``fsdp2`` (fully_shard, one parameter group per unit). The all-gather output is one buffer that
  ``split_with_sizes_copy`` copies out into the unsharded parameters on the compute stream
  (_fully_shard/_fsdp_collectives.py ``foreach_all_gather_copy_out``): read and write of every element, at each
  gather (forward and, resharded after forward, again for backward). The gradients are copied into one
  reduce-scatter buffer by ``torch._chunk_cat`` (``foreach_reduce_scatter_copy_in``, before the reduce-scatter
  stream waits on the compute stream: on the compute stream), cast to the reduce dtype on the way. BF16 and FP32
  reductions divide inside NCCL (ReduceOp.AVG: ``_get_gradient_divide_factors``, "use NCCL's built-in division to
  avoid separate div kernels"); FP16 pre-divides the buffer on the reduce-scatter stream.

Under a pipeline with ``pp_grad_sync`` step or round (grad_sync.py), FSDP2 runs once a step (or round), not every
micro-batch: torch's pipelining calls ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``
on every backward but the last (torch 2.13 torch/distributed/pipelining/stage.py, ``backward_maybe_with_nosync`` and
``perform_reduce_grad``) and torchtitan builds the pipeline's FSDP with ``reshard_after_forward=False``
(parallelize_llama.py), so the parameters are gathered (and copied out) once, and the accumulated gradients copied
into the reduce-scatter buffer once per reduction (grad_sync.reductions). FSDP1's concatenation is autograd's, so it
stays per micro-batch; its cast and divide run once per reduction.

Left out: the shard-sized casts and copy-ins (1/shard of these bytes), the optimizer step's own passes
(bandwidth_bound.py), CPU time of the hooks.
"""

from __future__ import annotations

from tandem.plan.inputs.model import dense_layer_params
from tandem.plan.terms.bandwidth_bound import BANDWIDTH_SHARE
from tandem.plan.terms.collectives import grad_reduce_bytes
from tandem.plan.terms.grad_sync import deferred, reductions
from tandem.plan.terms.params import stage_psi

NAME = {"fsdp1": "torch's FullyShardedDataParallel", "fsdp2": "torch's fully_shard"}


def units(m, s, psi: float) -> tuple[int, float]:
    """FSDP wraps one unit per transformer block (the root holds embeddings and head); other models one
    unit per largest layer. Returns (units, root parameters per GPU before sharding)."""
    if m.gpt is not None:
        n = max(1, m.gpt.layers // s.pp)
        lp = m.gpt.layer_params() if m.moe is None else dense_layer_params(m.moe)
        return n, max(0.0, psi - n * lp / s.tp)
    if m.largest_layer_params:
        return max(1, int(-(-psi // m.largest_layer_params))), 0.0
    return 1, 0.0


def copy_bytes(impl: str, p: float, r: float, fp16_reduce: bool = False, gathers: int = 2) -> tuple[float, float]:
    """Bytes per unsharded parameter per micro-batch: (on the compute stream, on the reduce-scatter stream ahead of
    the collective). ``p``: bytes of a gathered parameter (and of its gradient as autograd makes it), ``r``: of the
    reduced gradient, ``gathers``: all-gathers per micro-batch (2 when resharded after forward)."""
    if impl == "fsdp1":
        cast = p + r if r != p else 0.0
        return 2 * p, cast + 2 * r
    return gathers * 2 * p + (p + r), (2 * r if fp16_reduce else 0.0)


def plan_seconds(m, c, t, s, micro_batches: int) -> tuple[float, float]:
    """(compute-stream seconds a step, reduce-stream seconds per unsharded parameter a micro-batch) of a ZeRO-3 plan
    whose data-parallel ranks shard (0, 0 otherwise)."""
    if s.zero != 3 or s.dp * s.cp <= 1 or c.gpu.memory_Bps <= 0:
        return 0.0, 0.0
    bw = c.gpu.memory_Bps * BANDWIDTH_SHARE
    return stage_psi(m, s, t) * step_bytes(m, t, s, micro_batches) / bw, copy_bytes(t.fsdp, *dtypes(t, s))[1] / bw


def step_bytes(m, t, s, micro_batches: int) -> float:
    """Compute-stream bytes per unsharded parameter a step: per micro-batch x m, or when ``once`` one gather's
    copy-out 2p + the copy-in (p + r) at each of the step's reductions."""
    pb, rb, fp16 = dtypes(t, s)
    if not once(m, t, s):
        return copy_bytes(t.fsdp, pb, rb, fp16)[0] * micro_batches
    n = times(m, t, s, micro_batches)
    return 2 * pb + n * (pb + rb)


def once(m, t, s) -> bool:
    """FSDP2 kept unsharded across a pipeline's micro-batches and synced per reduction (grad_sync.deferred; MoE
    models stay per micro-batch, as data_parallel.dp_ops charges them)."""
    return deferred(t, s) and t.fsdp == "fsdp2" and m.moe is None


def times(m, t, s, micro_batches: int) -> int:
    """How often the compute-stream copies run a step: every micro-batch, or once per reduction
    (grad_sync.reductions: 1 a step, or one a round) when ``once``."""
    return reductions(t, s, micro_batches) if once(m, t, s) else micro_batches


def dtypes(t, s) -> tuple[int, int, bool]:
    """(gathered parameter bytes, reduced gradient bytes, fp16 reduction) of this plan."""
    r = grad_reduce_bytes(t.precision, s.zero, t.bytes["grad"], t.grad_reduce)
    fp16 = (t.grad_reduce or ("fp16" if t.precision == "fp16" else "")) == "fp16"
    if t.gather_bytes > t.bytes["param"]:   # autocast: fp32 parameters, so fp32 gradients reduced as they are
        return t.gather_bytes, t.gather_bytes, False   # fp32 reductions divide inside NCCL
    return t.gather_bytes, r, fp16
