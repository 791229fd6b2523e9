"""The cost model: one strategy in, memory / communication / time / throughput / cost out.

Pure arithmetic; ``evaluate`` is called tens of thousands of times by the search, so
it builds no strings (``tandem.plan.explain`` writes the sentences afterwards).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.errors import ConfigError
from tandem.plan import comm as C
from tandem.plan import efficiency as E
from tandem.plan import fsdp_runtime as FR
from tandem.plan import grad_sync as GS
from tandem.plan import memory_bound as MB
from tandem.plan import model_parallel as MP
from tandem.plan import moe_cp as MC
from tandem.plan import overlap as O
from tandem.plan import ring as RING
from tandem.plan import stages as ST
from tandem.plan.config import Strategy, Training
from tandem.plan.hardware import Cluster
from tandem.plan.host import default_threads
from tandem.plan.memory import Memory, expert_shard_group, memory, shard_group
from tandem.plan.model import ModelStats

# Fraction of the datasheet peak a model sustains when nothing better is known.
# gpt: Megatron-LM reaches 44-52% of A100 peak at scale (Narayanan et al. 2021, Table 1).
# cnn: the seed's own ResNet-50 step (256 images in 220 ms on one A100) is 18% of TF32 peak.
DEFAULT_EFFICIENCY = {"gpt": 0.5, "cnn": 0.18, "net": 0.4, "params": 0.5}
# Per architecture where a publication says otherwise: tandem/plan/efficiency.py, each with its source.
GEMM_FRACTION = 0.8  # a calibration's achieved FLOP/s is a large GEMM at ~80% of peak
# Megatron-LM's distributed data parallel: gradient buckets of max(40M, 1M x dp) parameters
# (megatron/core/distributed, bucket_size default), used here for ZeRO-1/2.
MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PER_DP = 40_000_000, 1_000_000


@dataclass
class CommOp:
    name: str
    collective: str
    bytes: float          # bytes each GPU contributes per call
    calls: int            # calls per step
    group: C.Group
    link: str
    time_s: float         # all calls of one step
    exposed_s: float
    chunks: int = 1       # framework calls per logical call (DDP buckets, FSDP blocks)
    algorithm: str = "ring"
    rule: str = "none"    # what hides it: buckets | prefetch | fsdp | manual | tp-bulk | tp-ring | pp-async | none
    window_s: float = 0.0 # compute it can hide behind, per logical call
    detail: tuple = ()    # fsdp: (blocks, gather, scatter, block fwd, block bwd, root gather, root scatter) s


@dataclass
class Plan:
    model: ModelStats
    cluster: Cluster
    training: Training
    strategy: Strategy
    grad_accum: int
    memory: Memory
    comm: list[CommOp]
    efficiency: float
    rate: float                 # FLOP/s per GPU assumed for compute
    hw_flops_per_gpu: float     # per step, incl. recompute
    model_flops_per_gpu: float  # per step, no recompute
    compute_s: float
    bubble_s: float
    compute_measured: bool
    warnings: list[str] = field(default_factory=list)
    explain: list[str] = field(default_factory=list)
    # calibration compute.model in use: (core-share slowdown, straggler factor), else None
    host_factors: tuple[float, float] | None = None
    stage_layers: tuple[int, ...] = ()   # layers per pipeline stage (pp > 1, transformers)
    stage_imbalance: float = 1.0         # slowest stage's FLOPs over the mean stage's
    attn_bf16_s: float = 0.0             # fp8: attention's seconds at the BF16 rate (included in compute_s)
    gemm_roofline: float = 1.0           # share of the rate the linear layers keep, memory-bound GEMMs (roofline)
    attn_s: float = 0.0                  # attention's (QK^T, AV) seconds, included in compute_s
    attn_ratio: float = 1.0              # attention kernels' rate over the linear layers' (efficiency.py)
    attn_kernel: str = ""                # which: unfused | fa2 | fa3 | cudnn | fused; linear layers' share per GEMM:
    linear_share: float = 1.0            # gemm.linear_factor (gemm_roofline, gemm_shape: each alone)
    gemm_shape: float = 1.0              # share of it their shapes keep (tile/wave quantization, gemm.py)
    fp8_cast_s: float = 0.0              # fp8: the casts' seconds at the memory bandwidth (in compute_s)
    cp_merge_s: float = 0.0              # torch's ring attention: fp32 merges of partial outputs (in compute_s)
    mem_bound_s: float = 0.0             # norms, adds, activations, loss at the memory bandwidth (in compute_s)
    optimizer_s: float = 0.0             # optimizer step + clipping at the memory bandwidth (in compute_s)
    fsdp_copy_s: float = 0.0             # FSDP's copies of unsharded params/grads, compute stream (fsdp_runtime.py)
    bubble_comm_s: float = 0.0           # tp / cp / ep communication the fill and drain repeat (in bubble_s)

    @property
    def comm_s(self) -> float:
        return sum(o.time_s for o in self.comm)

    @property
    def exposed_comm_s(self) -> float:
        return sum(o.exposed_s for o in self.comm)

    @property
    def serial_comm_share(self) -> float:
        """Communication's share of compute + bubble + communication with nothing overlapped (the seed's
        arithmetic: 33 / (220 + 33) = 13%)."""
        total = self.compute_s + self.bubble_s + self.comm_s
        return self.comm_s / total if total > 0 else 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    @property
    def samples_per_s(self) -> float:
        return self.training.global_batch / self.step_s if self.step_s > 0 else 0.0

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops_per_gpu / self.step_s / 1e12 if self.step_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.cluster.gpu.peak(self.training.precision)

    @property
    def compute_model_s(self) -> float:
        """Compute time of the step without recompute: what one GPU would spend per sample."""
        if self.hw_flops_per_gpu <= 0:
            return self.compute_s
        return self.compute_s * self.model_flops_per_gpu / self.hw_flops_per_gpu

    @property
    def speedup(self) -> float:
        """Throughput over one GPU running the same model at the same rate, with no communication
        and no bubble (memory ignored: the single GPU is hypothetical when the model does not fit)."""
        return self.strategy.world * self.compute_model_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def steps(self) -> int | None:
        t = self.training
        if t.steps:
            return int(t.steps)
        if t.tokens and self.model.gpt is not None:
            return int(-(-t.tokens // (t.global_batch * self.model.gpt.seq)))
        if t.samples:
            return int(-(-t.samples // t.global_batch))
        return None

    @property
    def sort_key(self) -> float:
        return self.step_s


def check(m: ModelStats, c: Cluster, t: Training, s: Strategy) -> str | None:
    """Why this strategy is invalid, or None. (The search skips; the CLI raises.)"""
    dp, tp, pp = s.dp, s.tp, s.pp   # read once: the search checks every candidate
    if s.world != c.world:
        if s.cp > 1:
            return (f"dp x tp x pp x cp = {s.dp}x{s.tp}x{s.pp}x{s.cp} = {s.world}, but the cluster has "
                    f"{c.world} GPUs")
        return f"dp x tp x pp = {s.dp}x{s.tp}x{s.pp} = {s.world}, but the cluster has {c.world} GPUs"
    if t.global_batch % dp:
        return f"global batch {t.global_batch} is not divisible by dp {dp}"
    per_replica = t.global_batch // dp
    if s.micro_batch and per_replica % s.micro_batch:
        return f"micro-batch {s.micro_batch} does not divide the {per_replica} samples per data-parallel rank"
    why = MC.check_cp_ep(m, s)
    if why:
        return why
    if m.gpt is None and (tp > 1 or pp > 1):
        return f"tp/pp need a transformer shape; {m.name} is a {m.kind} model (use dp and zero)"
    if m.gpt is not None:
        g = m.gpt
        if g.heads % tp or g.kv_heads % tp and tp % g.kv_heads:
            return f"heads {g.heads} (kv {g.kv_heads}) are not divisible by tp {s.tp}"
        if g.ffn % tp:
            return f"ffn {g.ffn} is not divisible by tp {s.tp}"
        if pp > g.layers:
            return f"pp {s.pp} is more than the {g.layers} layers"
        if s.stage_layers or s.schedule == "interleaved" and pp > 1:
            try:
                ST.chunks(g, pp, s.virtual, s.stage_layers)
            except ConfigError as e:
                return f"{e.field}: {e.message}"
    elif s.stage_layers:
        return "stage-layers: needs a transformer shape with pp > 1"
    mbs = per_replica // (s.micro_batch or per_replica)
    if s.schedule == "interleaved" and pp > 1 and mbs % ST.rounds(mbs, pp):
        return (f"the interleaved schedule runs {mbs} micro-batches in max(1, m // pp) = {ST.rounds(mbs, s.pp)} "
                f"rounds and needs m to be a multiple of them")
    return None


def validate(m: ModelStats, c: Cluster, t: Training, s: Strategy) -> None:
    if m.gpt is not None and 1 < s.pp <= m.gpt.layers and (s.stage_layers or s.schedule == "interleaved"):
        ST.chunks(m.gpt, s.pp, s.virtual, s.stage_layers)   # an impossible split: its own line and fix
    why = check(m, c, t, s)
    if why:
        fieldname = ("stage-layers" if why.startswith("stage-layers") else "dp" if "cluster has" in why
                     else why[:2] if why[:3] in ("cp ", "ep ")
                     else "micro-batch" if "micro-batch" in why
                     else "global-batch" if "global batch" in why else "tp" if "tp" in why else "pp")
        fix = {"ep": "choose --ep dividing dp and the experts (an MoE model only), or use --search",
               "cp": "choose --cp so that 2 x cp divides the sequence (a transformer only), or use --search",
               "rounds": "give m = global batch / (dp x micro-batch) that max(1, m // pp) divides (torch's "
                         "ScheduleInterleaved1F1B): any multiple of pp, or fewer than pp, does"}.get("rounds" if "rounds" in why else
            fieldname, "choose degrees whose product is the GPU count and that divide batch, heads and layers "
                       "(or use --search)")
        raise ConfigError(why, field=fieldname, fix=fix)


def default_efficiency(m: ModelStats, c: Cluster, t: Training) -> float:
    if t.efficiency is not None:
        return t.efficiency
    e = E.linear(c.gpu.name, m.kind) or DEFAULT_EFFICIENCY[m.kind]
    if t.precision == "fp8" and m.kind == "gpt":   # FP8 GEMMs' share (efficiency.py): transformers only
        e *= E.FP8_OVER_BF16
    if t.precision in c.achieved_flops:
        e = min(1.0, e / GEMM_FRACTION)
    return e


def evaluate(m: ModelStats, c: Cluster, t: Training, s: Strategy, mem: Memory | None = None, memo=None) -> Plan:
    """The plan for one valid strategy (call ``check``/``validate`` first); ``mem`` if already known; ``memo`` a
    dict the search keeps per (m, c, t) for the compute the ZeRO stage and the schedule leave alone."""
    by = t.bytes
    n = s.world
    per_replica = t.global_batch // s.dp
    if not s.micro_batch:
        s.micro_batch = per_replica
    mb = per_replica // s.micro_batch
    gpn = c.gpus_per_node

    # ---- compute
    eff = default_efficiency(m, c, t)
    rate = c.flops_ref(t.precision) * eff
    host = c.host_model
    factors = None
    if host is not None and t.efficiency is None and host.matches(m.name, m.flops_per_sample, t.precision):
        # The model itself was timed on one worker of this host: its rate already holds the
        # efficiency; workers sharing the cores and waiting for the slowest rank slow it down.
        threads = t.threads_per_worker or default_threads(host.cores, gpn)
        factors = (host.core_slowdown(gpn, threads), host.straggler_factor(n))
        eff = 1.0
        rate = host.achieved_flops / (factors[0] * factors[1])
    f_model = m.flops_per_sample or 0.0
    f_hw = f_model + m.recompute_flops_per_sample(s.recompute) * (1 if m.gpt is not None or s.recompute == "full" else 0)
    model_fpg = f_model * t.global_batch / n
    hw_fpg = f_hw * t.global_batch / n
    measured = t.compute_time_s is not None
    compute = t.compute_time_s if measured else (hw_fpg / rate if rate else 0.0)
    attn_bf16, gemm, attn_s, merge, cx = 0.0, 1.0, 0.0, 0.0, {}
    if m.gpt is not None and not measured and factors is None and rate:
        # linear layers at their GEMM shapes' rate, attention apart (FP8: attention stays BF16), FP8 casts
        cx = E.transformer_compute(m, c, t, s, hw_fpg, rate, eff, memo)
        attn_s, merge = RING.cp_attention(cx["attn_s"], m.gpt, s, c, t.cp_impl, mb, t.kv_repeat)   # ring.py (cp > 1)
        compute, gemm = cx["compute"] - cx["attn_s"] + attn_s + merge, cx["roofline"]
        attn_bf16 = attn_s if t.precision == "fp8" else 0.0
    # the slowest pipeline stage sets the pace (compute x imbalance); fill and drain: the bubble (stages.py)
    counts, imbalance, bubble = ST.pipeline(m, s, compute, mb)
    mean_compute, compute = compute, compute * imbalance

    # ---- communication
    ops: list[CommOp] = []
    dpg = C.layout(s.dp * s.cp, s.tp, gpn)   # cp ranks hold the same weights: gradients reduce over dp x cp
    if s.hsdp and s.zero >= 1:
        shard = shard_group(s, c)
        shard_g = C.layout(shard, s.tp, gpn)
        repl_g = C.layout(s.dp * s.cp // shard, s.tp * shard, gpn)
    else:
        shard_g, repl_g = dpg, C.Group(1, 1, 1)
    copy_s, side = FR.plan_seconds(m, c, t, s, mb) if cx and t.efficiency is None else (0.0, 0.0)
    if s.dp * s.cp > 1:
        ops += dp_ops(m, c, t, s, mb, compute, f_model, f_hw, dpg, shard_g, repl_g, side)
    if m.gpt is not None and (s.cp > 1 or s.ep > 1):
        stage_n = max(counts) if counts else m.gpt.layers
        attn_rate = E.attention_rate(c, t, s, m.gpt.seq, rate, eff) if factors is None else rate
        ops += [CommOp(**d) for d in MC.cp_ep_ops(m, c, s, by, mb, stage_n, attn_rate, s.recompute, t.cp_impl,
                                                         t.kv_repeat)]
    if m.gpt is not None and (s.tp > 1 or s.pp > 1):   # tp activations, pp p2p, tied embedding (model_parallel.py)
        ops += [CommOp(**d) for d in MP.mp_ops(m, c, t, s, counts, mb, rate * cx.get("gemm", 1.0), compute)]
    # the fill and drain repeat each micro-batch's tp / cp / ep communication as they repeat its compute
    bubble_comm = MP.bubble_comm(ops, counts, m.gpt.layers, s.pp, bubble, mean_compute) if m.gpt else 0.0
    bubble += bubble_comm
    mem = mem or memory(m, c, t, s, mb)
    opt_s = MB.optimizer_seconds(updated_params(m, s, c), c, t) if cx and t.efficiency is None else 0.0
    compute += opt_s + copy_s   # the step: after the last backward; the copies: not in the windows dp_ops used
    return Plan(m, c, t, s, mb, mem, ops, eff, rate, hw_fpg, model_fpg, compute, bubble, measured,
                host_factors=factors, stage_layers=counts, stage_imbalance=imbalance,
                attn_bf16_s=attn_bf16 * imbalance, gemm_roofline=gemm, attn_s=attn_s * imbalance,
                attn_ratio=cx.get("attn_ratio", 1.0), attn_kernel=cx.get("kernel", ""), linear_share=cx.get("gemm", 1.0),
                gemm_shape=cx.get("tiles", 1.0), fp8_cast_s=cx.get("cast_s", 0.0) * imbalance, cp_merge_s=merge * imbalance,
                mem_bound_s=cx.get("mem_s", 0.0) * imbalance, optimizer_s=opt_s, fsdp_copy_s=copy_s,
                bubble_comm_s=bubble_comm)


def stage_psi(m: ModelStats, s: Strategy) -> float:
    """Parameters per GPU on the stage holding the most: with a pipeline, the first (embedding) or the last
    (output layer, or the tied embedding's copy Megatron keeps there)."""
    if m.moe is not None:   # the non-expert weights; expert gradients go over their own group (dp_ops)
        return MC.stage_states(m.moe, ST.split(m.gpt, s.pp, s.stage_layers, ST.chunks_of(s)), s.tp, s.ep)[0]
    if m.gpt is None or s.pp == 1:
        return m.params / (s.tp * s.pp)
    return ST.busiest_stage_params(m.gpt, s.pp, s.stage_layers, ST.chunks_of(s)) / s.tp


def updated_params(m: ModelStats, s: Strategy, c: Cluster) -> float:
    """Parameters the optimizer step updates on the busiest GPU: its stage's, / the ZeRO shard group; an MoE
    model's experts too (split over ep x tp, sharded over the expert-data-parallel ranks)."""
    if m.moe is None:
        return stage_psi(m, s) / (shard_group(s, c) if s.zero else 1)
    ne, e = MC.stage_states(m.moe, ST.split(m.gpt, s.pp, s.stage_layers, ST.chunks_of(s)), s.tp, s.ep)
    return ne / (shard_group(s, c) if s.zero else 1) + e / (expert_shard_group(s, c) if s.zero else 1)


def dp_ops(m: ModelStats, c: Cluster, t: Training, s: Strategy, mb: int, compute: float, f_model: float,
           f_hw: float, dpg: C.Group, shard_g: C.Group, repl_g: C.Group, side: float = 0.0) -> list[CommOp]:
    """Data-parallel collectives with the framework's chunking (buckets, blocks) and overlap."""
    by = t.bytes
    psi = stage_psi(m, s)
    gb = C.grad_reduce_bytes(t.precision, s.zero, by["grad"], t.grad_reduce)   # FP32 for BF16 at ZeRO-1/2 (comm.py)
    pb = t.gather_bytes   # the stored weights' dtype: fp32 under autocast (config.Training.gather_bytes)
    gbytes, pbytes = psi * gb, psi * pb
    fwd_share = f_model / 3 / f_hw if f_hw > 0 else 1 / 3
    fwd = compute / mb * fwd_share       # one micro-batch's forward
    bwd = compute / mb - fwd             # ... and backward (with any recompute)
    # CPU workers (a calibration's host): gloo's threads share the cores compute runs on, so nothing
    # hides communication unless --overlap says so
    manual = t.overlap is not None or c.gpu.name == "cpu"
    frac = t.overlap or 0.0
    ops: list[CommOp] = []

    def op(name, kind, nbytes, calls, g, chunks, rule, window, exposed_fn):
        tm, algo = C.collective(kind, nbytes, chunks, g, c)
        if manual and rule != "none":
            exposed, rule = O.manual(tm * calls, frac, window * calls), "manual"
        else:
            exposed = exposed_fn(tm) * calls
        return CommOp(name, kind, nbytes, calls, g, C.link_name(g, c), tm * calls, exposed, chunks, algo, rule,
                      window)

    bucket = max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PER_DP * s.dp)
    if s.zero == 0:
        buckets = max(1, int(-(-gbytes // t.bucket_bytes)))
        ops.append(op("dp-grad", "all_reduce", gbytes, 1, dpg, buckets, "buckets", bwd,
                      lambda tm: O.pipelined(tm, buckets, bwd)))
    elif s.zero <= 2 or GS.deferred(t, s) and m.moe is None:   # bucketed reduce-scatter + gather (grad_sync.py)
        buckets = max(1, int(-(-psi // bucket)))
        ops += GS.dp_ops(op, t, s, GS.deferred(t, s) and m.moe is None, buckets, gbytes, pbytes, shard_g, mb, fwd, bwd)
    else:
        units, root = FR.units(m, s, psi)
        block = (psi - root) / units
        a = C.collective("all_gather", block * pb, 1, shard_g, c)[0]
        # side: seconds a parameter of FSDP's own kernels ahead of each reduce-scatter on its stream (fsdp_runtime.py)
        r = C.collective("reduce_scatter", block * gb, 1, shard_g, c)[0] + block * side
        ra = C.collective("all_gather", root * pb, 1, shard_g, c)[0] if root else 0.0
        rr = C.collective("reduce_scatter", root * gb, 1, shard_g, c)[0] + root * side if root else 0.0
        ex = O.fsdp(units, a, r, fwd / units, bwd / units, ra, rr)
        chunks = units + (1 if root else 0)
        # gathered before forward and again before backward (the root once), every micro-batch
        ag_s = (2 * units * a + ra) * mb
        rs_s = (units * r + rr) * mb
        ops.append(CommOp("fsdp-params", "all_gather", pbytes, 2 * mb, shard_g, C.link_name(shard_g, c),
                          ag_s, O.manual(ag_s, frac, compute) if manual else ex.gather_s * mb,
                          chunks, "ring", "manual" if manual else "fsdp", compute / mb,
                          (units, a, r, fwd / units, bwd / units, ra, rr)))
        ops.append(CommOp("dp-grad", "reduce_scatter", gbytes, mb, shard_g, C.link_name(shard_g, c), rs_s,
                          O.manual(rs_s, frac, bwd * mb) if manual else ex.scatter_s * mb,
                          chunks, "ring", "manual" if manual else "fsdp", bwd,
                          (units, a, r, fwd / units, bwd / units, ra, rr)))
        buckets = chunks
    if repl_g.size > 1:  # HSDP: each shard all-reduced across the replicas, chunk by chunk during backward
        shard = shard_g.size
        ops.append(op("hsdp-replicas", "all_reduce", gbytes / shard, 1, repl_g, buckets, "buckets", bwd,
                      lambda tm: O.pipelined(tm, buckets, bwd)))
    if m.moe is not None:
        # expert weights: reduced (and ZeRO-sharded) over the dp x cp / ep ranks holding the same experts, on
        # the stream the dense gradients use: they hide in what of backward the dense ones leave
        psi_e = MC.stage_states(m.moe, ST.split(m.gpt, s.pp, s.stage_layers, ST.chunks_of(s)), s.tp, s.ep)[1]
        eg = MC.expert_dp_group(s, c.gpus_per_node)
        if eg.size > 1 and psi_e > 0:
            left = max(0.0, bwd - sum(o.time_s / o.calls for o in ops if o.name == "dp-grad"))
            eb = max(1, int(-(-(psi_e * gb) // t.bucket_bytes))) if s.zero == 0 \
                else max(1, int(-(-psi_e // bucket)))
            if s.zero == 0:
                ops.append(op("ep-grad", "all_reduce", psi_e * gb, 1, eg, eb, "buckets", left,
                              lambda tm: O.pipelined(tm, eb, left)))
            else:
                ops.append(op("ep-grad", "reduce_scatter", psi_e * gb, 1 if s.zero == 1 else mb, eg, eb,
                              "buckets", left, lambda tm: O.pipelined(tm, eb, left)))
                if s.zero == 3:   # gathered before forward and backward, prefetched behind compute
                    ops.append(op("ep-params", "all_gather", psi_e * pb, 2 * mb, eg, eb, "prefetch",
                                  fwd, lambda tm: O.pipelined(tm, eb, fwd)))
                elif t.overlap_param_gather:
                    ops.append(op("ep-params", "all_gather", psi_e * pb, 1, eg, eb, "prefetch", fwd,
                                  lambda tm: O.pipelined(tm, eb, fwd)))
                else:
                    ops.append(op("ep-params", "all_gather", psi_e * pb, 1, eg, eb, "none", 0.0,
                                  lambda tm: tm))
    return ops
