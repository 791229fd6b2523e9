"""The plan's explanation: sentences that show its arithmetic in order (model, strategy, each communication term,
compute, step, memory, scaling, training time), plus warnings and what is left out. The sentences of each concept
live in explain_comm.py, explain_compute.py and explain_memory.py; this module puts them in order."""

from __future__ import annotations

from tandem.plan.inputs.runtime import RUNTIMES
from tandem.plan.cost import Plan
from tandem.plan.explain_comm import comm_sentence, exposed_sentence, fp32_reduce_source, overlap_rule
from tandem.plan.explain_compute import (attention_source, attn_seq, bandwidth_bound_lines, fsdp_copies_lines,
                                         pipeline_line)
from tandem.plan.explain_memory import activation_sentence, grad_sync_sentence, moe_states_sentence
from tandem.plan.inputs.host_model import default_threads
from tandem.plan.inputs.model import expert_params, moe_params
from tandem.plan.terms.collectives import grad_reduce_bytes
from tandem.plan.terms.params import expert_tp
from tandem.plan.terms.stages import chunks_of
from tandem.plan.units import gib, human_time, ms, pct, si


LEFT_OUT = ("data loading and preprocessing", "stragglers and network congestion", "kernel launch time",
            "framework differences beyond what --kernels says (one linear-layer figure per architecture)")


def explain(p: Plan) -> list[str]:
    m, c, t, s = p.model, p.cluster, p.training, p.strategy
    by = t.bytes
    out: list[str] = []
    f = m.flops_per_sample
    fl = f"; {si(f, 'FLOP')} per training sample (3 x forward)" if f else "; FLOPs unknown (bare --params)"
    count = f"{m.params / 1e9:.4g}B" if m.params >= 1e9 else f"{m.params / 1e6:.4g}M"
    out.append(f"Model {m.name}: {count} parameters ({m.source}){fl}.")
    rt = RUNTIMES[t.runtime]
    out.append(f"Runtime {rt.name}: {rt.what}; its rules here: "
               + "; ".join(f"{k}: {src}" for k, src in rt.sources) + ".")
    if m.moe is not None:
        e = m.moe
        out.append(f"MoE: {e.moe_layers} of {m.gpt.layers} layers route each token to top_k {e.top_k} of {e.experts} "
                   f"experts (inner size {e.expert_ffn}{f', + {e.shared} shared' if e.shared else ''}, capacity "
                   f"factor {e.capacity_factor:g}): {moe_params(e, active=True) / 1e9:.4g}B of "
                   f"{m.params / 1e9:.4g}B parameters active per token; expert weights "
                   + (f"{expert_params(e) / 1e9:.4g}B split over ep {s.ep} x tp {s.tp} x pp {s.pp}, their gradients "
                      f"reduced over dp x cp / ep = {s.dp} x {s.cp} / {s.ep} = {s.dp * s.cp // s.ep} GPUs."
                      if expert_tp(t, s) == s.tp else
                      f"{expert_params(e) / 1e9:.4g}B split over ep {s.ep} x pp {s.pp}, whole on each of the tp "
                      f"{s.tp} ranks (runtime {t.runtime}), their gradients reduced over (dp x cp / ep) x tp = "
                      f"{s.dp} x {s.cp} / {s.ep} x {s.tp} = {s.dp * s.cp // s.ep * s.tp} GPUs."))
    cp = f" x cp {s.cp}" if s.cp > 1 else ""
    out.append(f"Strategy {s.label()}: {s.world} GPUs = dp {s.dp}{f' (ep {s.ep} inside it)' if s.ep > 1 else ''}"
               f" x tp {s.tp} x pp {s.pp}{cp} on "
               f"{c.nodes} node(s) x {c.gpus_per_node} {c.gpu.name}; global batch {t.global_batch} = dp {s.dp} x "
               f"micro-batch {s.micro_batch} x {p.grad_accum} accumulation step(s).")
    if s.dp > 1 and m.moe is None:
        psi = m.params / (s.tp * s.pp)
        gb = grad_reduce_bytes(t.precision, s.zero, by["grad"], t.grad_reduce)
        why = (f" (--grad-reduce {t.grad_reduce}; {by['grad']} B stored)." if t.grad_reduce else
               " (FP16/BF16 halve the FP32 volume)." if gb == 2 else
               f" (reduced in FP32: {fp32_reduce_source(t, s)}; {by['grad']} B to store, {gb} B to send; "
               f"--grad-reduce bf16 if yours does not)." if gb != by["grad"] else ".")
        out.append(f"Gradients per GPU: {psi / 1e6:.4g}M params x {gb} B ({t.precision}) = {si(psi * gb)} per step"
                   + why)
    for o in p.comm:
        out.append(comm_sentence(p, o) + "; " + exposed_sentence(o, p))
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
                      + f") at {p.attn_ratio:.3g} of that rate ({attention_source(c.gpu.name, p.attn_kernel, *attn_seq(p))})"
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
    out += bandwidth_bound_lines(p) + fsdp_copies_lines(p)
    if s.pp > 1 and p.stage_layers and m.gpt is not None:
        out.append(pipeline_line(p))
    elif s.pp > 1:
        v = chunks_of(s)
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
               f"{gib(mem.other)}" + (f" + allocator reserve {t.allocator_reserve:g} x the tensors = "
                                      f"{gib(mem.reserve)}" if mem.reserve else "")
               + f" = {gib(mem.total)} of {gib(mem.capacity)}: "
               f"{'fits' if mem.fits else 'does NOT fit'}.")
    if m.moe is not None:
        out.append(moe_states_sentence(p))
    if m.gpt is not None:
        out += [x for x in (activation_sentence(p), grad_sync_sentence(p)) if x]
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
    if p.steps and step > 0 and not mem.fits:
        out.append(f"Training: {p.steps:,} steps, not timed or costed: the plan does not fit in memory.")
    elif p.steps and step > 0:
        secs = p.steps * step
        cost = (f", {c.currency} {secs * s.world / 3600 * c.price_per_gpu_hour:,.0f} at {c.price_per_gpu_hour:g} "
                f"{c.currency}/GPU-hour" if c.price_per_gpu_hour is not None else "")
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
