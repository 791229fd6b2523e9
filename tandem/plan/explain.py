"""Sentences that show the arithmetic of a plan, in the seed's style, plus warnings and omissions."""

from __future__ import annotations

import math

from tandem.plan import comm as C
from tandem.plan import efficiency as E
from tandem.plan import fsdp_runtime as FR
from tandem.plan import grad_sync as GS
from tandem.plan import memory_bound as MB
from tandem.plan import model_parallel as MP
from tandem.plan import nccl_algos as NA
from tandem.plan import stages as ST
from tandem.plan import tp_overlap as TPO
from tandem.plan.cost import Plan
from tandem.plan.explain_terms import attn_seq, gather_note
from tandem.plan.host import default_threads


def si(x: float, unit: str = "B") -> str:
    for k, p in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= p:
            return f"{x / p:.4g} {k}{unit}"
    return f"{x:.4g} {unit}"


def ms(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.4g} s"


def gib(x: float) -> str:
    g = x / 1024**3
    return f"{g:.3g} GiB" if g >= 1 or g == 0 else f"{x / 1024**2:.4g} MiB"


def pct(x: float) -> str:
    """A share to three significant digits (0.0504%, 3.64%, 13.1%): small shares stay visible."""
    return f"{100 * x:.3g}%"


def human_time(sec: float) -> str:
    if sec >= 86400:
        return f"{sec / 86400:.3g} days"
    if sec >= 3600:
        return f"{sec / 3600:.3g} hours"
    return f"{sec:.3g} s"


LEFT_OUT = ("data loading and preprocessing", "stragglers and network congestion", "kernel launch time",
            "framework differences beyond what --kernels says (one linear-layer figure per architecture)")


def _cp_ep_sentence(p: Plan, o) -> str:
    """Ring attention's K/V passing and MoE token routing, with their arithmetic (moe_cp.py)."""
    c, s, g = p.cluster, p.strategy, p.model.gpt
    link = f"{o.link} ({'crosses nodes' if o.group.crosses_nodes else 'inside a node'})"
    if o.name == "cp-ring":
        from tandem.plan.explain_layout import cp_sentence

        return cp_sentence(p, o, link)
    per, calls = o.detail
    moe = p.model.moe
    tokens = s.micro_batch * g.seq / (s.cp * s.tp)
    local = o.group.local
    return (f"ep-all-to-all: MoE token routing over ep {s.ep} GPUs on {link} ({local} of them per node): "
            f"{calls} all-to-alls per micro-batch ({'6' if s.recompute == 'full' else '4'} per MoE layer: dispatch "
            f"and combine, forward and backward) of b x s/(cp x tp) x top_k x capacity x h = {s.micro_batch} x "
            f"{tokens:.6g} x {moe.top_k} x {moe.capacity_factor:g} x {g.hidden} x {p.training.bytes['act']} B = "
            f"{si(o.bytes)} per GPU, ({local}-1)/{s.ep} of it on {c.intra.name}, ({s.ep}-{local})/{s.ep} through "
            f"the NICs at {si(c.node_rate_Bps / c.gpus_per_node, 'B/s')} per GPU, + {s.ep - 1} message "
            f"latencies = {ms(per)} per call, x {calls} x {p.grad_accum} micro-batches = {ms(o.time_s)} per step; "
            f"nothing hides it "
            f"(Megatron's default)")


def fp32_reduce_source(t, s) -> str:
    """Who reduces BF16 gradients in FP32 for this plan: FSDP2 under torch's pipelining when deferred."""
    if GS.deferred(t, s):
        return ("FSDP2's reduce_dtype, float32 in torchtitan's mixed-precision policy (mixed_precision_reduce), "
                "as torch's pipelining runs it")
    return "Megatron-LM's distributed optimizer reduces BF16 gradients in FP32, accumulate_allreduce_grads_in_fp32"


def _comm_sentence(p: Plan, o) -> str:
    if o.name in ("cp-ring", "ep-all-to-all"):
        return _cp_ep_sentence(p, o)
    c = p.cluster
    g = o.group
    per = o.time_s / max(1, o.calls)
    unit = ("buckets" if o.rule in ("buckets", "prefetch") else "bucket calls" if o.name.startswith("dp-") else
            "calls")   # a deferred reduce-scatter (rule none) still runs in its buckets
    chunked = f" in {o.chunks} {unit}" if o.chunks > 1 else ""
    head = (f"{o.name}: {o.collective} of {si(o.bytes)}{gather_note(p, o)} x {o.calls} call(s) per step{chunked} "
            f"over {g.size} GPUs, {C.describe(g, c)}{MP.WHY.get(o.name, '')}")
    algo, _, proto = o.algorithm.partition("/")
    how = (f" with NCCL's {proto} protocol ({proto_note(proto)})" if proto else "")
    if o.collective == "all_reduce" and algo == "nvls":
        return (f"{head}: NVLink SHARP (nvls: the switch reduces; each GPU sends {si(o.bytes / o.chunks)} once and "
                f"reads the sum once) {si(o.bytes / o.chunks)} / ({NA.NVLS_SHARE:.3g} x "
                f"{si(c.intra.bandwidth_Bps, 'B/s')}) + {NA.NVLS_US:g} us = {ms(per / max(1, o.chunks))} per call, "
                f"{ms(per)} per step")
    if algo == "pat":
        return (f"{head}: PAT (NCCL's parallel aggregated trees, one GPU per node: the ring's bytes, "
                f"log2({g.nodes}) network hops instead of {g.nodes}-1) = {ms(per)} per "
                + ("step" if o.calls == 1 else f"call, x {o.calls} = {ms(o.time_s)} per step"))
    if o.collective == "all_reduce" and g.nodes > 1 and algo == "tree":
        nn, l = g.nodes, g.local
        p_ = proto or "Simple"
        share = f" x {NA.PROTO_SHARE[p_]:.3g}" if proto else ""
        a_in = NA._hop(c.intra.latency_s, "tree", NA._hw(c.intra.name), p_) if l > 1 else 0.0
        a_out = NA._hop(c.inter.latency_s, "tree", "net", p_)
        base = NA.BASE_US[("tree", p_)]
        return (f"{head}: NCCL-style tree{how} (its latency grows with log2 of the nodes; the ring's 2x({nn}-1) "
                f"steps per call cost more at {si(o.bytes / o.chunks)} per call): 2 x {si(o.bytes / o.chunks)}"
                f"{f' / {l}' if l > 1 else ''} / ({C.TREE_BW}{share} x {si(c.node_rate_Bps / c.gpus_per_node, 'B/s')}"
                f" per GPU){' + inside the node' if l > 1 else ''} + {base:g} us + 2x({l - 1} x {a_in * 1e6:.3g} us + "
                f"{math.ceil(math.log2(nn))} x {a_out * 1e6:.3g} us) latency, = {ms(per)} per step")
    if proto:
        head += how
    if o.collective == "all_reduce" and g.nodes > 1:
        nn, l, gpn = g.nodes, g.local, c.gpus_per_node
        net = c.node_rate_Bps
        inter = 2 * (nn - 1) / nn * o.bytes / l / (net / gpn)
        rate = (f"{si(o.bytes)} / {si(net, 'B/s')}" if l == gpn else
                f"{si(o.bytes)} / {l} / ({si(net, 'B/s')} / {gpn} GPUs sharing the NICs)")
        return (f"{head}: ring across nodes 2x({nn}-1)/{nn} x {rate} = {ms(inter)}, "
                f"plus {ms(max(0.0, per - inter))} {'inside nodes and ' if l > 1 else ''}latency = {ms(per)} per call")
    if o.collective == "all_reduce":
        n = g.size
        return (f"{head}: 2x({n}-1)/{n} x {si(o.bytes)} / {si(c.intra.rate_Bps, 'B/s')} + latency "
                f"= {ms(per)} per call")
    return f"{head}: ring, {ms(per)} per call"


def proto_note(proto: str) -> str:
    return {"LL": "4 B of data per 8 B store: half the rate, the lowest latency per hop",
            "LL128": "120 B of data per 128 B line: 94% of the rate, low latency per hop"}.get(proto, "")


def overlap_rule(p: Plan) -> str:
    """How the framework this strategy stands for overlaps its data-parallel communication."""
    s, t = p.strategy, p.training
    if p.cluster.gpu.name == "cpu":
        return "none: CPU workers' gloo threads share the cores compute runs on"
    if s.zero == 0:
        return "as DDP: gradient buckets all-reduced during backward, the last bucket exposed"
    if GS.deferred(t, s) and p.model.moe is None:
        return GS.overlap_rule(t, s, p.grad_accum)
    if s.zero <= 2:
        gather = ("during the next forward (--overlap-param-gather, Megatron)" if t.overlap_param_gather
                  else "after the step, exposed (--overlap-param-gather to hide it as Megatron does)")
        return (f"as ZeRO-{s.zero}: gradient buckets reduce-scattered during backward, the last exposed; "
                f"parameter all-gather {gather}")
    return ("as FSDP: each block's all-gather prefetched during the previous block's forward/backward, "
            "reduce-scatter during backward; first gather and last reduce-scatter exposed")


def _exposed_sentence(o, p: Plan) -> str:
    if o.name in ("cp-ring", "ep-all-to-all"):
        return "the arithmetic is above."
    k, per = max(1, o.chunks), o.time_s / max(1, o.calls)
    ex = o.exposed_s / max(1, o.calls)
    if o.exposed_s >= o.time_s:
        return ("all of it on the critical path" + (" (after the optimizer step)" if o.name == "dp-params"
                                                     else "") + ".")
    if o.rule in ("buckets", "prefetch"):
        where = "backward" if o.rule == "buckets" else "the next forward"
        return (f"{k} buckets during {ms(o.window_s)} of {where}: exposed = max(last bucket {ms(per / k)}, "
                f"{ms(per)} - {ms(o.window_s)} x ({k}-1)/{k}) = {ms(ex)} per call, {ms(o.exposed_s)} per step.")
    if o.rule == "fsdp" and o.detail:
        n, a, r, f, b, ra, rr = o.detail
        mb = max(1, o.calls // 2) if o.collective == "all_gather" else max(1, o.calls)
        if o.collective == "all_gather":
            return (f"per micro-batch, {n} blocks + root: forward a + (n-1) x max(0, a - f) = {ms(a)} + {n - 1} x "
                    f"max(0, {ms(a)} - {ms(f)}), backward a + (n-1) x max(0, a - b) with b = {ms(b)}, + root "
                    f"{ms(ra)} = {ms(o.exposed_s / mb)} exposed, x {mb} micro-batches = {ms(o.exposed_s)}.")
        return (f"per micro-batch: r + (n-1) x (max(0, a + r - b) - max(0, a - b)) = {ms(r)} + {n - 1} x "
                f"(max(0, {ms(a)} + {ms(r)} - {ms(b)}) - max(0, {ms(a)} - {ms(b)})) + root {ms(rr)} = "
                f"{ms(o.exposed_s / mb)} exposed, x {mb} micro-batches = {ms(o.exposed_s)}.")
    if o.rule.startswith("tp-"):
        return TPO.sentence(o, o.group.size)
    if o.rule == "pp-async":
        return MP.p2p_sentence(o, p.strategy.pp, p.strategy.virtual, p.grad_accum)
    if o.rule == "manual":
        return f"--overlap hides part of {ms(o.window_s * o.calls)}: {ms(o.exposed_s)} of it exposed."
    return f"{ms(o.exposed_s)} of it exposed."


def explain(p: Plan) -> list[str]:
    m, c, t, s = p.model, p.cluster, p.training, p.strategy
    by = t.bytes
    out: list[str] = []
    f = m.flops_per_sample
    fl = f"; {si(f, 'FLOP')} per training sample (3 x forward)" if f else "; FLOPs unknown (bare --params)"
    count = f"{m.params / 1e9:.4g}B" if m.params >= 1e9 else f"{m.params / 1e6:.4g}M"
    out.append(f"Model {m.name}: {count} parameters ({m.source}){fl}.")
    if m.moe is not None:
        from tandem.plan import moe_cp as MC

        e = m.moe
        out.append(f"MoE: {e.moe_layers} of {m.gpt.layers} layers route each token to top_k {e.top_k} of {e.experts} "
                   f"experts (inner size {e.expert_ffn}{f', + {e.shared} shared' if e.shared else ''}, capacity "
                   f"factor {e.capacity_factor:g}): {MC.params(e, active=True) / 1e9:.4g}B of "
                   f"{m.params / 1e9:.4g}B parameters active per token; expert weights "
                   f"{MC.expert_params(e) / 1e9:.4g}B split over ep {s.ep} x tp {s.tp} x pp {s.pp}, their gradients "
                   f"reduced over dp x cp / ep = {s.dp} x {s.cp} / {s.ep} = {s.dp * s.cp // s.ep} GPUs.")
    cp = f" x cp {s.cp}" if s.cp > 1 else ""
    out.append(f"Strategy {s.label()}: {s.world} GPUs = dp {s.dp}{f' (ep {s.ep} inside it)' if s.ep > 1 else ''}"
               f" x tp {s.tp} x pp {s.pp}{cp} on "
               f"{c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name}; global batch {t.global_batch} = dp {s.dp} x "
               f"micro-batch {s.micro_batch} x {p.grad_accum} accumulation step(s).")
    if s.dp > 1 and m.moe is None:
        psi = m.params / (s.tp * s.pp)
        gb = C.grad_reduce_bytes(t.precision, s.zero, by["grad"], t.grad_reduce)
        why = (f" (--grad-reduce {t.grad_reduce}; {by['grad']} B stored)." if t.grad_reduce else
               " (FP16/BF16 halve the FP32 volume)." if gb == 2 else
               f" (reduced in FP32: {fp32_reduce_source(t, s)}; {by['grad']} B to store, {gb} B to send; "
               f"--grad-reduce bf16 if yours does not)." if gb != by["grad"] else ".")
        out.append(f"Gradients per GPU: {psi / 1e6:.4g}M params x {gb} B ({t.precision}) = {si(psi * gb)} per step"
                   + why)
    for o in p.comm:
        out.append(_comm_sentence(p, o) + "; " + _exposed_sentence(o, p))
    if p.compute_measured:
        out.append(f"Compute: {ms(p.compute_s)} per step, as measured (--compute-time).")
    elif p.hw_flops_per_gpu and p.host_factors:
        h, (share, strag) = c.host_model, p.host_factors
        out.append(f"Compute: {si(p.hw_flops_per_gpu, 'FLOP')} per worker per step at {si(h.achieved_flops, 'FLOP/s')}"
                   f" (this model measured on one worker, calibration) / {share:.2f} core sharing ({c.gpus_per_node}"
                   f" workers x {t.threads_per_worker or default_threads(h.cores, c.gpus_per_node)} threads on"
                   f" {h.cores} cores, {h.background:.1f} other runnable threads) / {strag:.2f} waiting for the"
                   f" slowest of {s.world} ranks = {ms(p.compute_s)}.")
    elif p.hw_flops_per_gpu:
        out.append(f"Compute: {si(p.hw_flops_per_gpu, 'FLOP')} per GPU per step "
                   f"({t.global_batch} samples x {si(p.hw_flops_per_gpu * s.world / t.global_batch, 'FLOP')} / "
                   f"{s.world} GPUs) at {si(c.flops_ref(t.precision), 'FLOP/s')} "
                   f"{'achieved (calibration)' if t.precision in c.achieved_flops else 'peak'} x "
                   f"{p.efficiency:.2f} efficiency"
                   + (f"; attention (QK^T, AV: {ms(p.attn_s / p.stage_imbalance)}, {p.attn_kernel}"
                      + (", in BF16: Transformer Engine runs only the linear layers in FP8" if p.attn_bf16_s else "")
                      + f") at {p.attn_ratio:.3g} of that rate ({E.attention_source(c.gpu.name, p.attn_kernel, *attn_seq(p))})"
                      if abs(p.attn_ratio - 1.0) > 5e-4 or p.attn_bf16_s else "")
                   + (f", the linear layers at {p.linear_share:.3g} of it ({p.gemm_shape:.3g} for "
                      f"their GEMM shapes at tp {s.tp}: measured {'FP8' if t.precision == 'fp8' else 'BF16'} GEMM "
                      f"speeds by N and K, gemm.py; x {p.gemm_roofline:.3g} roofline at micro-batch {s.micro_batch}"
                      f" x {m.gpt.seq} tokens over {si(c.gpu.memory_Bps, 'B/s')})"
                      if p.linear_share < 0.9995 and m.gpt else "")
                   + (f", + FP8 casts {ms(p.fp8_cast_s / p.stage_imbalance)} (4 B per element of each linear "
                      f"layer's input and output gradient, every micro-batch, and of the weights once, at "
                      f"{si(c.gpu.memory_Bps, 'B/s')})" if p.fp8_cast_s else "")
                   + (f", + torch's fp32 merges of ring attention's partial outputs "
                      f"{ms(p.cp_merge_s / p.stage_imbalance)}" if p.cp_merge_s else "")
                   + (f", + memory-bound ops {ms(p.mem_bound_s / p.stage_imbalance)}" if p.mem_bound_s else "")
                   + _compute_total(p))
    else:
        out.append("Compute: unknown for a bare --params model; give --compute-time or a model shape.")
    out += MB.explain(p) + FR.explain(p)
    if s.pp > 1 and p.stage_layers and m.gpt is not None:
        from tandem.plan.explain_layout import pipeline_line

        out.append(pipeline_line(p))
    elif s.pp > 1:
        v = ST.chunks_of(s)
        frac = (s.pp - 1) / (v * p.grad_accum + s.pp - 1)
        out.append(f"Pipeline bubble ({s.schedule}): (p-1)/({'v x ' if v > 1 else ''}m+p-1) = {s.pp - 1}/"
                   f"({v * p.grad_accum}+{s.pp - 1}) = {frac:.1%} of compute+bubble = {ms(p.bubble_s)}.")
    step = p.step_s
    if step > 0:
        how = f"overlap {t.overlap:g}" if t.overlap is not None else f"overlap {overlap_rule(p)}"
        line = (f"Step: {ms(p.compute_s)} compute + {ms(p.exposed_comm_s)} exposed communication + "
                f"{ms(p.bubble_s)} bubble = {ms(step)}; communication is {pct(p.exposed_comm_s / step)} "
                f"of the step ({how}).")
        if p.comm_s > p.exposed_comm_s:
            line += (f" With nothing overlapped: {ms(p.compute_s)} + {ms(p.comm_s)} + {ms(p.bubble_s)} = "
                     f"{ms(p.compute_s + p.comm_s + p.bubble_s)}, communication {pct(p.serial_comm_share)} "
                     f"of the step.")
        out.append(line)
    mem = p.memory
    out.append(f"Memory per GPU: params {gib(mem.params)} + grads {gib(mem.grads)} + optimizer "
               f"{gib(mem.optimizer)} (zero {s.zero}, {t.bytes['param']}+{t.bytes['grad']}+{t.optimizer_bytes} "
               f"bytes/param before sharding) + activations {gib(mem.activations)} + other "
               f"{gib(mem.other)} = {gib(mem.total)} of {gib(mem.capacity)}: "
               f"{'fits' if mem.fits else 'does NOT fit'}.")
    # a module of its own that imports this one's formatters (si, gib), so imported here
    from tandem.plan.explain_memory import activation_sentence, moe_states_sentence

    if m.moe is not None:
        out.append(moe_states_sentence(p))
    if m.gpt is not None:
        out += [x for x in (activation_sentence(p), GS.sentence(p)) if x]
    if step > 0 and p.compute_model_s > 0 and s.world > 1:
        why = ""
        if p.speedup / s.world < 0.75:
            parts = {"communication": p.exposed_comm_s, "pipeline bubble": p.bubble_s,
                     "recompute": p.compute_s - p.compute_model_s}
            worst = max(parts, key=parts.get)
            why = (f" Far from linear: {worst} takes {parts[worst] / step:.0%} of every step"
                   + (f" ({c.inter.name} between nodes is the bottleneck)." if worst == "communication"
                      and any(o.group.nodes > 1 for o in p.comm) else "."))
        out.append(f"Scaling: {s.world} GPUs give {p.speedup:.3g}x one GPU ({p.speedup / s.world:.0%} "
                   f"efficiency).{why}")
    if p.steps and step > 0:
        secs = p.steps * step
        cost = (f", {secs * s.world / 3600 * c.price_per_gpu_hour:,.0f} at {c.price_per_gpu_hour:g}/GPU-hour"
                if c.price_per_gpu_hour is not None else "")
        out.append(f"Training: {p.steps:,} steps x {ms(step)} = {human_time(secs)} = "
                   f"{secs * s.world / 3600:,.0f} GPU-hours{cost}.")
    # the optimizer step is timed (its own line) unless --efficiency/--compute-time gave the compute
    out.append("Left out: " + "; ".join(LEFT_OUT + (() if p.optimizer_s else ("optimizer-step time",))) + ".")
    return out


def _compute_total(p: Plan) -> str:
    """The sum: (linear + attention + casts + merges + memory-bound) x the slowest stage's imbalance, + the
    optimizer step (once, not scaled: it runs after the last backward on each stage's own parameters)."""
    per_stage = p.compute_s - p.optimizer_s - p.fsdp_copy_s
    out = f" = {ms(per_stage / p.stage_imbalance)}" if (p.optimizer_s or p.fsdp_copy_s or p.stage_imbalance != 1) else ""
    if p.stage_imbalance != 1:
        out += f", x {p.stage_imbalance:.4g} on the slowest pipeline stage = {ms(per_stage)}"
    if p.optimizer_s:
        out += f", + optimizer step {ms(p.optimizer_s)}"
    out += f", + FSDP copies {ms(p.fsdp_copy_s)}" if p.fsdp_copy_s else ""
    return out + f" = {ms(p.compute_s)}."


def warnings(p: Plan) -> list[str]:
    t, s, c = p.training, p.strategy, p.cluster
    w = list(p.memory.notes)
    if t.ref_batch and t.global_batch > t.ref_batch:
        k = t.global_batch / t.ref_batch
        if t.warmup_steps == 0:
            w.append(f"global batch {t.global_batch} is {k:g}x the batch the LR was tuned at ({t.ref_batch}) "
                     "and there is no warm-up: linear LR scaling needs warm-up (Goyal et al. 2017).")
    if p.model.kind == "cnn" and t.global_batch > 8192:
        w.append(f"global batch {t.global_batch} > 8192: beyond the largest batch Goyal et al. 2017 trained "
                 "ResNet-50 at without accuracy loss (linear scaling + 5 epochs warm-up).")
    if s.tp > c.gpus_per_node:
        w.append(f"tp {s.tp} crosses nodes ({c.gpus_per_node} GPUs per node): tensor-parallel all-reduces "
                 f"then run on {c.inter.name}.")
    if not p.memory.fits:
        w.append("does not fit in memory; try a smaller --micro-batch with gradient accumulation, "
                 "--zero, --recompute, or --search.")
    return w

