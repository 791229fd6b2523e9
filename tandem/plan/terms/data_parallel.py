"""Data-parallel communication of a step: DDP's bucketed all-reduce, ZeRO-1/2's reduce-scatter and parameter
gather (grad_sync.py under a pipeline), FSDP's per-block gathers and reduce-scatters, HSDP's replica all-reduce, and
an MoE model's expert gradients, each with the framework's chunking and what of it compute hides (dp_overlap.py)."""

from __future__ import annotations

from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.model import ModelStats
from tandem.plan.inputs.runtime import RUNTIMES
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.collectives import CommOp, Group, collective, grad_reduce_bytes, link_name
from tandem.plan.terms.dp_overlap import FSDPExposed, manual, pipelined
from tandem.plan.terms.dp_overlap import fsdp as fsdp_exposed
from tandem.plan.terms.expert import expert_dp_group
from tandem.plan.terms.fsdp_copies import units as fsdp_units
from tandem.plan.terms.grad_sync import deferred
from tandem.plan.terms.grad_sync import dp_ops as zero_ops
from tandem.plan.terms.params import expert_states, expert_tp, stage_psi

# Megatron-LM's distributed data parallel: gradient buckets of max(40M, 1M x dp) parameters
# (megatron/core/distributed, bucket_size default), used here for ZeRO-1/2.
MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PER_DP = 40_000_000, 1_000_000


def dp_ops(m: ModelStats, c: Cluster, t: Training, s: Strategy, mb: int, compute: float, f_model: float,
           f_hw: float, dpg: Group, shard_g: Group, repl_g: Group, side: float = 0.0) -> list[CommOp]:
    """Data-parallel collectives with the framework's chunking (buckets, blocks) and overlap."""
    by = t.bytes
    psi = stage_psi(m, s, t)
    gb = grad_reduce_bytes(t.precision, s.zero, by["grad"], t.grad_reduce)   # FP32 for BF16 at ZeRO-1/2 (collectives.py)
    pb = t.gather_bytes   # the stored weights' dtype: fp32 under autocast (training.Training.gather_bytes)
    gbytes, pbytes = psi * gb, psi * pb
    fwd_share = f_model / 3 / f_hw if f_hw > 0 else 1 / 3
    fwd = compute / mb * fwd_share       # one micro-batch's forward
    bwd = compute / mb - fwd             # ... and backward (with any recompute)
    # CPU workers (a calibration's host): gloo's threads share the cores compute runs on, so nothing
    # hides communication unless --overlap says so
    overlap_given = t.overlap is not None or c.gpu.name == "cpu"
    frac = t.overlap or 0.0
    ops: list[CommOp] = []

    def op(name, kind, nbytes, calls, g, chunks, rule, window, exposed_fn):
        tm, algo = collective(kind, nbytes, chunks, g, c)
        if overlap_given and rule != "none":
            exposed, rule = manual(tm * calls, frac, window * calls), "manual"
        else:
            exposed = exposed_fn(tm) * calls
        return CommOp(name, kind, nbytes, calls, g, link_name(g, c), tm * calls, exposed, chunks, algo, rule,
                      window)

    bucket = max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PER_DP * s.dp)
    if s.zero == 0:
        buckets = max(1, int(-(-gbytes // t.bucket_bytes)))
        ops.append(op("dp-grad", "all_reduce", gbytes, 1, dpg, buckets, "buckets", bwd,
                      lambda tm: pipelined(tm, buckets, bwd)))
    elif s.zero <= 2 or deferred(t, s) and m.moe is None:   # bucketed reduce-scatter + gather (grad_sync.py)
        buckets = max(1, int(-(-psi // bucket)))
        ops += zero_ops(op, t, s, deferred(t, s) and m.moe is None, buckets, gbytes, pbytes, shard_g, mb, fwd, bwd)
    else:
        units, root = fsdp_units(m, s, psi)
        block = (psi - root) / units
        a, a_algo = collective("all_gather", block * pb, 1, shard_g, c)
        # side: seconds a parameter of FSDP's own kernels ahead of each reduce-scatter on its stream (fsdp_copies.py)
        r, r_algo = collective("reduce_scatter", block * gb, 1, shard_g, c)
        r += block * side
        ra = collective("all_gather", root * pb, 1, shard_g, c)[0] if root else 0.0
        rr = collective("reduce_scatter", root * gb, 1, shard_g, c)[0] + root * side if root else 0.0
        ex = fsdp_exposed(units, a, r, fwd / units, bwd / units, ra, rr)
        if not RUNTIMES[t.runtime].zero3_prefetch:   # each module waits for its own gather (runtime.py)
            ex = FSDPExposed(2 * units * a + ra, ex.scatter_s)
        chunks = units + (1 if root else 0)
        # gathered before forward and again before backward (the root once), every micro-batch
        ag_s = (2 * units * a + ra) * mb
        rs_s = (units * r + rr) * mb
        ops.append(CommOp("fsdp-params", "all_gather", pbytes, 2 * mb, shard_g, link_name(shard_g, c),
                          ag_s, manual(ag_s, frac, compute) if overlap_given else ex.gather_s * mb,
                          chunks, a_algo, "manual" if overlap_given else
                          ("fsdp" if RUNTIMES[t.runtime].zero3_prefetch else "none"), compute / mb,
                          (units, a, r, fwd / units, bwd / units, ra, rr)))
        ops.append(CommOp("dp-grad", "reduce_scatter", gbytes, mb, shard_g, link_name(shard_g, c), rs_s,
                          manual(rs_s, frac, bwd * mb) if overlap_given else ex.scatter_s * mb,
                          chunks, r_algo, "manual" if overlap_given else "fsdp", bwd,
                          (units, a, r, fwd / units, bwd / units, ra, rr)))
        buckets = chunks
    if repl_g.size > 1:  # HSDP: each shard all-reduced across the replicas, chunk by chunk during backward
        shard = shard_g.size
        ops.append(op("hsdp-replicas", "all_reduce", gbytes / shard, 1, repl_g, buckets, "buckets", bwd,
                      lambda tm: pipelined(tm, buckets, bwd)))
    if m.moe is not None:
        # expert weights: reduced (and ZeRO-sharded) over the ranks holding the same experts (dp x cp / ep, x tp
        # where the tp ranks hold them whole), on the stream the dense gradients use: they hide in what of
        # backward the dense ones leave
        psi_e = expert_states(m, s, t)[1]
        eg = expert_dp_group(s, c.gpus_per_node, expert_tp(t, s))
        if eg.size > 1 and psi_e > 0:
            left = max(0.0, bwd - sum(o.time_s / o.calls for o in ops if o.name == "dp-grad"))
            eb = max(1, int(-(-(psi_e * gb) // t.bucket_bytes))) if s.zero == 0 \
                else max(1, int(-(-psi_e // bucket)))
            if s.zero == 0:
                ops.append(op("ep-grad", "all_reduce", psi_e * gb, 1, eg, eb, "buckets", left,
                              lambda tm: pipelined(tm, eb, left)))
            else:
                ops.append(op("ep-grad", "reduce_scatter", psi_e * gb, 1 if s.zero == 1 else mb, eg, eb,
                              "buckets", left, lambda tm: pipelined(tm, eb, left)))
                if s.zero == 3:   # gathered before forward and backward, prefetched behind compute
                    ops.append(op("ep-params", "all_gather", psi_e * pb, 2 * mb, eg, eb, "prefetch",
                                  fwd, lambda tm: pipelined(tm, eb, fwd)))
                elif t.overlap_param_gather:
                    ops.append(op("ep-params", "all_gather", psi_e * pb, 1, eg, eb, "prefetch", fwd,
                                  lambda tm: pipelined(tm, eb, fwd)))
                else:
                    ops.append(op("ep-params", "all_gather", psi_e * pb, 1, eg, eb, "none", 0.0,
                                  lambda tm: tm))
    return ops


