"""The cost model: one strategy in, memory / communication / time / throughput / cost out.

The composer: ``check`` says whether a strategy can run, ``evaluate`` adds up the terms (terms/: compute,
pipeline stages, each communication term, memory) into a Plan. Pure arithmetic; ``evaluate`` is called tens of
thousands of times by the search, so it builds no strings (explain.py writes the sentences afterwards).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.errors import ConfigError
from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.host_model import default_threads
from tandem.plan.inputs.model import ModelStats
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.bandwidth_bound import optimizer_seconds
from tandem.plan.terms.collectives import CommOp, Group, layout
from tandem.plan.terms.context import cp_attention, cp_op
from tandem.plan.terms.data_parallel import dp_ops
from tandem.plan.terms.efficiency import FP8_OVER_BF16, attention_rate, linear, transformer_compute
from tandem.plan.terms.expert import ep_op
from tandem.plan.terms.fsdp_copies import plan_seconds
from tandem.plan.terms.memory import Memory, memory
from tandem.plan.terms.params import expert_tp, shard_group, updated_params
from tandem.plan.terms.pipeline import bubble_comm, pp_ops
from tandem.plan.terms.stages import chunks, pipeline, rounds
from tandem.plan.terms.tensor_parallel import tp_op

# Fraction of the datasheet peak a model sustains when nothing better is known.
# gpt: Megatron-LM reaches 44-52% of A100 peak at scale (Narayanan et al. 2021, Table 1).
# cnn: the reference case's ResNet-50 step (256 images in 220 ms on one A100) is 18% of TF32 peak.
DEFAULT_EFFICIENCY = {"gpt": 0.5, "cnn": 0.18, "net": 0.4, "params": 0.5}
# Per architecture where a publication says otherwise: terms/efficiency.py, each with its source.
GEMM_FRACTION = 0.8  # a calibration's achieved FLOP/s is a large GEMM at ~80% of peak


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
    fsdp_copy_s: float = 0.0             # FSDP's copies of unsharded params/grads, compute stream (fsdp_copies.py)
    bubble_comm_s: float = 0.0           # tp / cp / ep communication the fill and drain repeat (in bubble_s)

    @property
    def comm_s(self) -> float:
        return sum(o.time_s for o in self.comm)

    @property
    def exposed_comm_s(self) -> float:
        return sum(o.exposed_s for o in self.comm)

    @property
    def serial_comm_share(self) -> float:
        """Communication's share of compute + bubble + communication with nothing overlapped (the reference case's
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
    why = check_cp_ep(m, s, expert_tp(t, s))
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
                chunks(g, pp, s.virtual, s.stage_layers)
            except ConfigError as e:
                return f"{e.field}: {e.message}"
    elif s.stage_layers:
        return "stage-layers: needs a transformer shape with pp > 1"
    mbs = per_replica // (s.micro_batch or per_replica)
    if s.schedule == "interleaved" and pp > 1 and mbs % rounds(mbs, pp):
        return (f"the interleaved schedule runs {mbs} micro-batches in max(1, m // pp) = {rounds(mbs, s.pp)} "
                f"rounds and needs m to be a multiple of them")
    return None


def validate(m: ModelStats, c: Cluster, t: Training, s: Strategy) -> None:
    if m.gpt is not None and 1 < s.pp <= m.gpt.layers and (s.stage_layers or s.schedule == "interleaved"):
        chunks(m.gpt, s.pp, s.virtual, s.stage_layers)   # an impossible split: its own line and fix
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
    e = linear(c.gpu.name, m.kind) or DEFAULT_EFFICIENCY[m.kind]
    if t.precision == "fp8" and m.kind == "gpt":   # FP8 GEMMs' share (efficiency.py): transformers only
        e *= FP8_OVER_BF16
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
        cx = transformer_compute(m, c, t, s, hw_fpg, rate, eff, memo)
        attn_s, merge = cp_attention(cx["attn_s"], m.gpt, s, c, t.cp_impl, mb, t.kv_repeat)   # context.py (cp > 1)
        compute, gemm = cx["compute"] - cx["attn_s"] + attn_s + merge, cx["roofline"]
        attn_bf16 = attn_s if t.precision == "fp8" else 0.0
    # the slowest pipeline stage sets the pace (compute x imbalance); fill and drain: the bubble (stages.py)
    counts, imbalance, bubble = pipeline(m, s, compute, mb)
    mean_compute, compute = compute, compute * imbalance

    # ---- communication
    ops: list[CommOp] = []
    dpg = layout(s.dp * s.cp, s.tp, gpn)   # cp ranks hold the same weights: gradients reduce over dp x cp
    if s.hsdp and s.zero >= 1:
        shard = shard_group(s, c)
        shard_g = layout(shard, s.tp, gpn)
        repl_g = layout(s.dp * s.cp // shard, s.tp * shard, gpn)
    else:
        shard_g, repl_g = dpg, Group(1, 1, 1)
    copy_s, side = plan_seconds(m, c, t, s, mb) if cx and t.efficiency is None else (0.0, 0.0)
    if s.dp * s.cp > 1:
        ops += dp_ops(m, c, t, s, mb, compute, f_model, f_hw, dpg, shard_g, repl_g, side)
    if m.gpt is not None and (s.cp > 1 or s.ep > 1):
        stage_n = max(counts) if counts else m.gpt.layers
        if s.cp > 1:   # ring attention's K/V exchange (context.py)
            attn_rate = attention_rate(c, t, s, m.gpt.seq, rate, eff) if factors is None else rate
            ops.append(CommOp(**cp_op(m, c, s, by, mb, stage_n, attn_rate, s.recompute, t.cp_impl, t.kv_repeat)))
        if s.ep > 1 and m.moe is not None:   # MoE token routing (expert.py)
            ops.append(CommOp(**ep_op(m, c, s, by, mb, stage_n, s.recompute)))
    if m.gpt is not None and s.tp > 1:   # tp activations (tensor_parallel.py)
        layers = max(counts) if counts else m.gpt.layers // s.pp
        ops.append(CommOp(**tp_op(m, c, t, s, layers, mb, rate * cx.get("gemm", 1.0))))
    if m.gpt is not None and s.pp > 1:   # pp p2p, tied embedding (pipeline.py)
        ops += [CommOp(**d) for d in pp_ops(m, c, t, s, mb, compute)]
    # the fill and drain repeat each micro-batch's tp / cp / ep communication as they repeat its compute
    fill_comm = bubble_comm(ops, counts, m.gpt.layers, s.pp, bubble, mean_compute) if m.gpt else 0.0
    bubble += fill_comm
    mem = mem or memory(m, c, t, s, mb)
    opt_s = optimizer_seconds(updated_params(m, s, c, t), c, t) if cx and t.efficiency is None else 0.0
    compute += opt_s + copy_s   # the step: after the last backward; the copies: not in the windows dp_ops used
    return Plan(m, c, t, s, mb, mem, ops, eff, rate, hw_fpg, model_fpg, compute, bubble, measured,
                host_factors=factors, stage_layers=counts, stage_imbalance=imbalance,
                attn_bf16_s=attn_bf16 * imbalance, gemm_roofline=gemm, attn_s=attn_s * imbalance,
                attn_ratio=cx.get("attn_ratio", 1.0), attn_kernel=cx.get("kernel", ""), linear_share=cx.get("gemm", 1.0),
                gemm_shape=cx.get("tiles", 1.0), fp8_cast_s=cx.get("cast_s", 0.0) * imbalance, cp_merge_s=merge * imbalance,
                mem_bound_s=cx.get("mem_s", 0.0) * imbalance, optimizer_s=opt_s, fsdp_copy_s=copy_s,
                bubble_comm_s=fill_comm)


def check_cp_ep(m, s, etp: int | None = None) -> str | None:
    """Why cp/ep do not fit this model and strategy (``ModelStats``, ``Strategy``), or None. ``etp``: the tp
    ranks one expert is split over (``params.expert_tp``; default tp): only a split expert needs tp | expert_ffn."""
    if s.cp > 1:
        if m.gpt is None:
            return f"cp {s.cp} needs a transformer shape; {m.name} is a {m.kind} model"
        if m.gpt.seq % (2 * s.cp):
            # load-balanced causal ring attention cuts the sequence into 2 x cp chunks (Megatron-core)
            return (f"cp {s.cp} does not split seq {m.gpt.seq} into 2 x cp = {2 * s.cp} equal chunks "
                    f"({m.gpt.seq} % {2 * s.cp} = {m.gpt.seq % (2 * s.cp)})")
    if s.ep > 1:
        if m.moe is None:
            return f"ep {s.ep} needs an MoE model (mixtral-8x7b, deepseek-v3 or --experts); {m.name} is dense"
        if s.dp % s.ep:
            return f"ep {s.ep} does not divide dp {s.dp} ({s.dp} % {s.ep} = {s.dp % s.ep})"
        if m.moe.experts % s.ep:
            return (f"ep {s.ep} does not divide the {m.moe.experts} experts "
                    f"({m.moe.experts} % {s.ep} = {m.moe.experts % s.ep})")
    etp = s.tp if etp is None else etp
    if m.moe is not None and m.moe.expert_ffn % etp:
        return (f"expert ffn {m.moe.expert_ffn} is not divisible by tp {etp} (the runtime splits each expert "
                f"over the tp ranks)")
    return None
