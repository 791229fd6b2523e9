"""explain[] sentences for the compute terms, with their arithmetic: where attention's kernel speed comes from,
the bandwidth-bound kernels and the optimizer step, FSDP's copies, the uneven and interleaved pipeline's pace and
bubble (stages.py), and the ring-attention blocks' kernels (context.py)."""

from __future__ import annotations

from tandem.plan.cost import Plan
from tandem.plan.terms.attention_kernels import (BWD_FLOPS, FIG, FIRST_GEN, causal_speed, interpolate, over_fa2,
                                                 speed)
from tandem.plan.terms.bandwidth_bound import (BANDWIDTH_SHARE, layer_bytes, layer_ops, optimizer_bytes_per_param,
                                               optimizer_parts)
from tandem.plan.terms.context import KERNEL as CP_KERNEL
from tandem.plan.terms.context import block_length, diagonal_fraction
from tandem.plan.terms.efficiency import (A100_FA2, A100_REF_LEN, GEMM_SHARE, H100_PEAK, KERNEL_SOURCE, arch_of,
                                          curve_of, kernel_shares)
from tandem.plan.terms.fsdp_copies import NAME as FSDP_NAME
from tandem.plan.terms.fsdp_copies import copy_bytes
from tandem.plan.terms.fsdp_copies import dtypes as fsdp_dtypes
from tandem.plan.terms.fsdp_copies import once as fsdp_once
from tandem.plan.terms.fsdp_copies import times as fsdp_times
from tandem.plan.terms.fsdp_copies import units as fsdp_units
from tandem.plan.terms.params import stage_psi, updated_params
from tandem.plan.terms.stages import chunks, chunks_of, rounds, split_name
from tandem.plan.units import ms, si


def pipeline_line(p: Plan) -> str:
    """The uneven (and interleaved) pipeline's pace, fill and drain, with their arithmetic."""
    s, g = p.strategy, p.model.gpt
    v = chunks_of(s)
    hc = g.logits_fwd_flops_per_token() / g.layer_fwd_flops_per_token()
    imb, mb = p.stage_imbalance, p.grad_accum
    # the mean stage's micro-batch time, without the optimizer step and FSDP copies (the bubble excludes them)
    per_mb = (p.compute_s - p.optimizer_s - p.fsdp_copy_s) / imb / mb if p.compute_s else 0.0
    fill = (p.bubble_s - p.bubble_comm_s) / per_mb if per_mb else 0.0
    comm_mb = p.bubble_comm_s / fill if fill else 0.0   # the mean stage's tp / cp / ep seconds a micro-batch
    src = split_name(s, g)
    ch = ""
    if v > 1:
        c = chunks(g, s.pp, v, s.stage_layers)
        ch = (f", in {v} interleaved chunks a stage (first {'/'.join(map(str, c[0]))}, second "
              f"{'/'.join(map(str, c[1]))}, last {'/'.join(map(str, c[-1]))}; torch's ScheduleInterleaved1F1B: "
              f"{rounds(mb, s.pp)} round(s) of {mb // rounds(mb, s.pp)} micro-batches)")
    wait = ("each other stage's largest chunk (its first chunk plus every rise) forward and backward"
            if v > 1 else "every other stage's time once")
    if v > 1 and mb < s.pp:
        wait += f", + (v-1)(p-m)/v = {(v - 1) * (s.pp - mb) / v:.4g} for the m < p rounds"
    return (f"Pipeline stages hold {','.join(map(str, p.stage_layers))} layers ({src}){ch}, the embedding on the "
            f"first and the logits ({hc:.3g} of a layer's FLOPs) on the last: the slowest stage has {imb:.4g}x the "
            f"mean stage's FLOPs and sets the pace: compute {ms(p.compute_s)} (m = {mb} micro-batches on the slowest "
            f"stage) + fill and drain {fill:.4g} mean-stage micro-batch times ({wait}) x {ms(per_mb)}"
            + (f" compute, + the same times of its tensor-parallel / ring / all-to-all communication, {fill:.4g} x "
               f"{ms(comm_mb)} = {ms(p.bubble_comm_s)}: {ms(p.bubble_s - p.bubble_comm_s)} + "
               f"{ms(p.bubble_comm_s)}" if p.bubble_comm_s else "")
            + f" = {ms(p.bubble_s)}, {p.bubble_s / (p.compute_s + p.bubble_s):.1%} of compute+bubble (equal stages: "
            f"(p-1)/({'v x ' if v > 1 else ''}m+p-1) = {(s.pp - 1) / (v * mb + s.pp - 1):.1%}; Narayanan et al. "
            f"2021 §2.2).")


def ring_blocks(p: Plan, impl: str) -> str:
    """The ring's kernels as efficiency.attention_times computes them: the unmasked blocks at s/(cp x sqrt 2) tokens
    and the diagonal step's causal block on s/cp tokens, each at its (forward, backward) share of peak, summed
    to attention's seconds in the Compute line; '' where attention runs at the linear rate (no curve, --efficiency)."""
    s, g, t, c = p.strategy, p.model.gpt, p.training, p.cluster
    L, kern = block_length(g.seq, s.cp), p.attn_kernel or CP_KERNEL[impl]
    prec = "bf16" if t.precision == "fp8" else t.precision
    ring = kernel_shares(c.gpu.name, kern, L, True, g.hidden // g.heads) if t.efficiency is None else None
    if ring is None or prec not in ("bf16", "fp16"):
        return ""
    peak = c.flops_ref(prec) / (GEMM_SHARE if prec in c.achieved_flops else 1.0)
    rc = {"none": 0, "selective": 3, "full": 1}[s.recompute]
    flops = g.seq * g.layers * g.attn_score_fwd_flops_per_token() * t.global_batch / s.world
    d = diagonal_fraction(s.cp, t.cp_impl)
    diag = kernel_shares(c.gpu.name, kern, g.seq / s.cp, False, g.hidden // g.heads) if d else None
    parts = [(1 - d, ring, L, True)] + ([(d, diag, g.seq / s.cp, False)] if diag is not None else [])
    total = sum(w * ((1 + rc) * flops / (peak * sh[0]) + 2 * flops / (peak * sh[1])) for w, sh, _, _ in parts)
    terms = " + ".join(f"{w:.4g} x ({1 + rc}/{sh[0]:.4g} + 2/{sh[1]:.4g})" for w, sh, _, _ in parts)
    where = "; ".join(_share_source(c.gpu.name, kern, n, unmasked, sh) for _, sh, n, unmasked in parts)
    diag_txt = (f", and the diagonal step's causal block (1/cp = {d:.4g} of the FLOPs, on s/cp = {g.seq / s.cp:.0f} "
                f"tokens: torch's step i = 0 and TE's step 0 run with the causal mask)" if diag is not None else "")
    return (f". The ring's attention kernels ({kern}): unmasked blocks of s/(cp x sqrt 2) = {L:.0f} tokens"
            f"{diag_txt}, at their share of the {si(peak, 'FLOP/s')} peak forward / backward in the planner's "
            f"full-square count ({where}): attention = "
            f"F x ({terms}) / peak, F = {si(flops, 'FLOP')} of QK^T and AV forward per GPU a step = {ms(total)}, "
            f"the Compute line's attention")


def _share_source(gpu: str, kern: str, length: float, unmasked: bool, sh: tuple[float, float]) -> str:
    """Where one block's (forward, backward) shares come from, with the arithmetic that gives them."""
    what = f"{'unmasked' if unmasked else 'causal'} at {length:.0f}"
    if arch_of(gpu).arch == "hopper":   # the FlashAttention-3 paper's TFLOP/s, backward counted as 2.5 F
        f = speed(kern, length) if unmasked else causal_speed(kern, length)
        b = speed(kern, length, True) if unmasked else causal_speed(kern, length, True)
        fig = "figures" if unmasked else "causal forward figure; backward x its causal/unmasked ratio"
        return (f"{what}: {f:.0f} / {b:.0f} TFLOP/s (FlashAttention-3 paper's {fig}), 2 x {f:.0f} / "
                f"{H100_PEAK} = {sh[0]:.4g} and 2 x {b:.0f} x 2/{BWD_FLOPS} / {H100_PEAK} = {sh[1]:.4g}")
    if kern == "fa2":   # Ampere / Ada: the A100 share at 2k along the H100 curve; no causal figure on A100
        ref = A100_REF_LEN
        return (f"{what}: {A100_FA2} x fa2 curve({length:.0f}) / curve({ref}) = {A100_FA2} x "
                f"{speed(kern, length):.0f}/{speed(kern, ref):.0f} = {sh[0]:.4g} forward, {A100_FA2} x "
                f"{speed(kern, length, True):.0f}/{speed(kern, ref, True):.0f} = {sh[1]:.4g} backward"
                + ("" if unmasked else "; no causal figure on A100: the unmasked curve"))
    return f"{what}: {sh[0]:.4g} / {sh[1]:.4g}"


def attn_seq(p) -> tuple[float, int]:
    """(sequence, head dim) one attention call runs on, for the attention kernel's arithmetic; (0, 128) where
    there is no single sequence (no transformer shape, or ring attention, whose blocks ``ring_blocks`` prices)."""
    g = p.model.gpt
    if g is None or p.strategy.cp > 1:
        return 0.0, 128
    return float(g.seq), g.hidden // g.heads


def attention_source(gpu_name: str, k: str, length: float = 0.0, head_dim: int = 128) -> str:
    """Where the kernel's speed comes from; a first-generation kernel on one sequence (``length``) with the
    arithmetic of its share of FlashAttention-2's speed."""
    a = arch_of(gpu_name)
    if a is None:
        return ""
    if curve_of(a, k) and k in FIRST_GEN and length:
        return KERNEL_SOURCE[(a.arch, k)] + ": " + _first_gen_arithmetic(k, curve_of(a, k), length, head_dim)
    if curve_of(a, k):
        return KERNEL_SOURCE[(a.arch, k)]
    if k == "unfused" and a.unfused != 1.0:
        return "no published figure: " + KERNEL_SOURCE[("ampere", "unfused")] + ", as a share of the linear rate"
    return a.attention_source or "no published figure: as fast as the linear layers"


def _first_gen_arithmetic(kernel: str, arch: str, length: float, head_dim: int = 128) -> str:
    """The arithmetic of ``attention_kernels.over_fa2``: the bars it reads and their product."""
    hd = 64 if head_dim <= 64 else 128
    f = FIG[(arch, hd)]
    gpu = {"hopper": "H100", "ampere": "A100"}[arch]
    txt = (f"{gpu} FlashAttention {interpolate(f['fa1'], length):.4g} / FlashAttention-2 {interpolate(f['fa2'], length):.4g} "
           f"TFLOP/s at {length:.0f} tokens, causal, head dim {hd}")
    if kernel == "triton":
        a = FIG[("ampere", hd)]
        txt += f" x A100 Triton {interpolate(a['triton'], length):.4g} / FlashAttention {interpolate(a['fa1'], length):.4g}"
    return txt + f" = {over_fa2(kernel, arch, length, head_dim):.3g} of FlashAttention-2's speed"


def _coef(c: tuple, g) -> str:
    names = ("h", "ffn", "(h+kv)", "V")
    return " + ".join(f"{k:g}{n}" for k, n in zip(c, names) if k)


def bandwidth_bound_lines(p: Plan) -> list[str]:
    """The arithmetic of the memory-bound terms of a plan (bandwidth_bound.py)."""
    m, c, t, s = p.model, p.cluster, p.training, p.strategy
    if m.gpt is None or not (p.mem_bound_s or p.optimizer_s):
        return []
    g = m.gpt
    fp8 = t.precision == "fp8"
    per_layer, per_model = layer_bytes(g, t.kernels, t.bytes["act"], s.recompute, t.fused_loss, fp8)
    ops = "; ".join(f"{o.name} {_coef(o.fwd, g) or 0} fwd, {_coef(o.bwd, g) or 0} bwd"
                    for o in layer_ops(g, t.kernels, t.fused_loss, fp8))
    tokens = t.global_batch * g.seq
    rc = " (full recompute: forward twice)" if s.recompute == "full" else ""
    out = [f"Memory-bound ops ({t.kernels} kernels; element passes per token: {ops}): {si(per_layer)} a layer"
           f"{rc} x {g.layers} layers + {si(per_model)} the loss = {si(g.layers * per_layer + per_model)} a token "
           f"at {t.bytes['act']} B an element, x {tokens:,} tokens / {s.world} GPUs at {BANDWIDTH_SHARE} x "
           f"{si(c.gpu.memory_Bps, 'B/s')} = {ms(p.mem_bound_s / p.stage_imbalance)} (terms/bandwidth_bound.py; norms, "
           "residual adds, activation, rotary, loss: memory-bound, so FLOPs do not time them)."]
    if p.optimizer_s:
        params = updated_params(m, s, c, t)
        parts = " + ".join(f"{k} {b} B" for k, b in optimizer_parts(t).items())
        out.append(f"Optimizer step: {parts} = {optimizer_bytes_per_param(t)} B per parameter x {si(params, '')} "
                   f"parameters this GPU updates{' (experts included)' if m.moe is not None else ''}{' (ZeRO-sharded)' if s.zero else ''} at {BANDWIDTH_SHARE} x "
                   f"{si(c.gpu.memory_Bps, 'B/s')} = {ms(p.optimizer_s)}.")
    return out


def _fsdp_step_arithmetic(m, t, s, micro_batches: int, psi: float) -> str:
    """fsdp_copies.step_bytes's arithmetic: per micro-batch x m, or once a gather + at each reduction."""
    pb, rb, fp16 = fsdp_dtypes(t, s)
    if not fsdp_once(m, t, s):
        comp = copy_bytes(t.fsdp, pb, rb, fp16)[0]
        return (f"{comp:g} B per unsharded parameter (p = {pb} B, r = {rb} B) x {psi / 1e9:.4g}B "
                f"parameters x {micro_batches} micro-batch(es)")
    n = fsdp_times(m, t, s, micro_batches)
    return (f"(2 x p once + (p + r) x {n} reduction(s)) = {2 * pb + n * (pb + rb):g} B per unsharded parameter a step "
            f"(p = {pb} B, r = {rb} B; pp_grad_sync {t.pp_grad_sync}: torch's pipelining keeps FSDP2 unsharded and skips "
            f"gradient sync until the last backward, stage.py) x {psi / 1e9:.4g}B parameters")


def fsdp_copies_lines(p: Plan) -> list[str]:
    """The arithmetic of the FSDP copies' line (fsdp_copies.py), reproducing ``p.fsdp_copy_s``."""
    if not p.fsdp_copy_s:
        return []
    t, s, c = p.training, p.strategy, p.cluster
    psi, bw = stage_psi(p.model, s, t), c.gpu.memory_Bps * BANDWIDTH_SHARE
    pb, rb, fp16 = fsdp_dtypes(t, s)
    side = copy_bytes(t.fsdp, pb, rb, fp16)[1]
    how = ("backward concatenates the views' gradients into the flat gradient (split's backward), 2 x p"
           if t.fsdp == "fsdp1" else "all-gather copy-out 2 x p at each gather + reduce-scatter copy-in p + r")
    line = (f"FSDP copies (--fsdp {t.fsdp}: {FSDP_NAME[t.fsdp]}; terms/fsdp_copies.py): {how} = "
            f"{_fsdp_step_arithmetic(p.model, t, s, p.grad_accum, psi)} at {BANDWIDTH_SHARE} x {c.gpu.memory_Bps / 1e12:.4g} TB/s = {ms(p.fsdp_copy_s)}, on the compute stream")
    if side:
        n, root = fsdp_units(p.model, s, psi)
        block = (psi - root) / n
        what = ("cast to the reduce dtype p + r and " if t.fsdp == "fsdp1" and rb != pb else "") + "in-place divide 2 x r"
        line += (f"; the {what} = {side:g} B per parameter run on the reduce-scatter stream ahead of each "
                 f"collective: {block / 1e9:.4g}B parameters a block = {ms(block * side / bw)}, counted in its r")
    return [line + "."]
