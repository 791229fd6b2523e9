"""explain[] sentences for the layout terms: uneven and interleaved pipeline stages (stages.py) and ring
attention (moe_cp.cp_comm, ring.py), with their arithmetic."""

from __future__ import annotations

from tandem.plan import ring as RING
from tandem.plan import stages as ST
from tandem.plan.cost import Plan
from tandem.plan.explain import ms, si


def pipeline_line(p: Plan) -> str:
    """The uneven (and interleaved) pipeline's pace, fill and drain, with their arithmetic."""
    s, g = p.strategy, p.model.gpt
    v = ST.chunks_of(s)
    hc = g.logits_fwd_flops_per_token() / g.layer_fwd_flops_per_token()
    imb, mb = p.stage_imbalance, p.grad_accum
    # the mean stage's micro-batch time, without the optimizer step and FSDP copies (the bubble excludes them)
    per_mb = (p.compute_s - p.optimizer_s - p.fsdp_copy_s) / imb / mb if p.compute_s else 0.0
    fill = (p.bubble_s - p.bubble_comm_s) / per_mb if per_mb else 0.0
    comm_mb = p.bubble_comm_s / fill if fill else 0.0   # the mean stage's tp / cp / ep seconds a micro-batch
    src = ST.split_name(s, g)
    ch = ""
    if v > 1:
        c = ST.chunks(g, s.pp, v, s.stage_layers)
        ch = (f", in {v} interleaved chunks a stage (first {'/'.join(map(str, c[0]))}, second "
              f"{'/'.join(map(str, c[1]))}, last {'/'.join(map(str, c[-1]))}; torch's ScheduleInterleaved1F1B: "
              f"{ST.rounds(mb, s.pp)} round(s) of {mb // ST.rounds(mb, s.pp)} micro-batches)")
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


def cp_sentence(p: Plan, o, link: str) -> str:
    """Ring attention: the K/V passing (Megatron's p2p ring, or torch's all-gather), the ring's shorter attention
    kernels and torch's fp32 merges (moe_cp.cp_comm, ring.py)."""
    s, g, t = p.strategy, p.model.gpt, p.training
    sf, sb, bf, bb, passes, impl = o.detail
    chunk = g.seq // s.cp
    layers = o.calls // max(1, (passes + 1) * (1 if impl == "allgather" else s.cp - 1) * p.grad_accum)
    kvw = RING.kv_width(g, s.tp, t.kv_repeat)
    kv = o.bytes / (s.cp if impl == "allgather" else 1)   # all-gather CP's bytes are the gathered cp chunks
    width = "h/tp: K/V repeated to the query heads" if t.kv_repeat else "kv_dim / min(tp, kv heads)"
    head = (f"cp-ring: ring attention over cp {s.cp} GPUs on {link}: each holds s/cp = {g.seq}/{s.cp} = {chunk} "
            f"tokens; K and V of a chunk, 2 x b x s/cp x kv width ({width}) = 2 x "
            f"{s.micro_batch} x {chunk} x {kvw} x {t.bytes['act']} B = {si(kv)}")
    rc = " x 2 (full recompute)" if passes > 1 else ""
    if impl == "torch":
        body = (f"; torch's context_parallel (all-gather rotation, torchtitan's default): forward all-gathers the "
                f"{s.cp - 1} other chunks once ({ms(sf)}), hidden only behind the first block's attention "
                f"(4 x b x (s/cp)^2 x h/tp FLOPs = {ms(bf)}), backward all-gathers them again (behind {ms(bb)}) and "
                f"passes dK, dV in fp32 around the ring ({ms(sb)} a step, {s.cp} sends: {s.cp - 1} each behind "
                f"{ms(bb)}, the last waited for after the loop with nothing to hide it): exposed = layers x "
                f"(max(0, {ms(sf)} - {ms(bf)}){rc} + max(0, {ms(sf)} - {ms(bb)}) + {s.cp - 1} x "
                f"max(0, {ms(sb)} - {ms(bb)}) + {ms(sb)})")
    elif impl == "allgather":
        body = (f"; Meta's all-gather CP (Llama 3 paper §3.3.2): per layer and micro-batch one all-gather of the "
                f"{s.cp} chunks' K and V, {s.cp} x {si(kv)} = {si(o.bytes)} gathered (the JSON's bytes; "
                f"({s.cp}-1)/{s.cp} of it, {si(o.bytes * (s.cp - 1) / s.cp)}, reaches each GPU) ({ms(sf)}){rc} and "
                f"one reduce-scatter of dK, dV of the same {si(o.bytes)} backward ({ms(sb)}), "
                f"both exposed (\"the all-gather communication latency is exposed in the critical path\"): "
                f"({ms(sf)}{rc} + {ms(sb)}) a layer")
        return (f"{head}{body} x {layers} layers x {p.grad_accum} micro-batches = {ms(o.exposed_s)}"
                f"{_blocks(p, impl)}")
    else:
        body = (f"; per layer and micro-batch {s.cp - 1} steps pass them ({ms(sf)} a step forward, {ms(sb)} backward "
                f"with dK, dV), each behind one block's attention, 4 x b x (s/cp)^2 x h/tp FLOPs = {ms(bf)} forward, "
                f"{ms(bb)} backward: exposed = steps x (max(0, {ms(sf)} - {ms(bf)}){rc} + max(0, {ms(sb)} - "
                f"{ms(bb)}))")
    blocks = _blocks(p, impl)
    merge = (f"; torch merges the partial outputs in eager fp32 ops: (cp-1) x layers x micro-batches x ({passes} x "
             f"({RING.MERGE_Q[0]} B x b s/cp h/tp + {RING.MERGE_KV[0]} B x 2 b s/cp kv) + {RING.MERGE_Q[1]} B x "
             f"b s/cp h/tp + {RING.MERGE_KV[1]} B x 2 b s/cp kv) / {si(p.cluster.gpu.memory_Bps, 'B/s')} HBM = "
             f"{ms(p.cp_merge_s)} of compute" if p.cp_merge_s else "")
    # torch's body already counts the steps inside each layer's term; the p2p ring's is per step
    over = f" x {layers} layers" if impl == "torch" else f" over {s.cp - 1} steps x {layers} layers"
    return (f"{head}{body}{over} x {p.grad_accum} micro-batches = {ms(o.exposed_s)} of {ms(o.time_s)}"
            f"{blocks}{merge}")


def _blocks(p: Plan, impl: str) -> str:
    """The ring's kernels as efficiency.attention_times computes them: the unmasked blocks at s/(cp x sqrt 2) tokens
    and the diagonal step's causal block on s/cp tokens, each at its (forward, backward) share of peak, summed
    to attention's seconds in the Compute line; '' where attention runs at the linear rate (no curve, --efficiency)."""
    from tandem.plan import efficiency as E

    s, g, t, c = p.strategy, p.model.gpt, p.training, p.cluster
    L, kern = RING.block_length(g.seq, s.cp), p.attn_kernel or RING.KERNEL[impl]
    prec = "bf16" if t.precision == "fp8" else t.precision
    ring = E.kernel_shares(c.gpu.name, kern, L, True, g.hidden // g.heads) if t.efficiency is None else None
    if ring is None or prec not in ("bf16", "fp16"):
        return ""
    peak = c.flops_ref(prec) / (E.GEMM_SHARE if prec in c.achieved_flops else 1.0)
    rc = {"none": 0, "selective": 3, "full": 1}[s.recompute]
    flops = g.seq * g.layers * g.attn_score_fwd_flops_per_token() * t.global_batch / s.world
    d = RING.diagonal_fraction(s.cp, t.cp_impl)
    diag = E.kernel_shares(c.gpu.name, kern, g.seq / s.cp, False, g.hidden // g.heads) if d else None
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
    from tandem.plan import efficiency as E

    what = f"{'unmasked' if unmasked else 'causal'} at {length:.0f}"
    if E.arch_of(gpu).arch == "hopper":   # the FlashAttention-3 paper's TFLOP/s, backward counted as 2.5 F
        f = RING.speed(kern, length) if unmasked else RING.causal_speed(kern, length)
        b = RING.speed(kern, length, True) if unmasked else RING.causal_speed(kern, length, True)
        fig = "figures" if unmasked else "causal forward figure; backward x its causal/unmasked ratio"
        return (f"{what}: {f:.0f} / {b:.0f} TFLOP/s (FlashAttention-3 paper's {fig}), 2 x {f:.0f} / "
                f"{E.H100_PEAK} = {sh[0]:.4g} and 2 x {b:.0f} x 2/{RING.BWD_FLOPS} / {E.H100_PEAK} = {sh[1]:.4g}")
    if kern == "fa2":   # Ampere / Ada: the A100 share at 2k along the H100 curve; no causal figure on A100
        ref = E.A100_REF_LEN
        return (f"{what}: {E.A100_FA2} x fa2 curve({length:.0f}) / curve({ref}) = {E.A100_FA2} x "
                f"{RING.speed(kern, length):.0f}/{RING.speed(kern, ref):.0f} = {sh[0]:.4g} forward, {E.A100_FA2} x "
                f"{RING.speed(kern, length, True):.0f}/{RING.speed(kern, ref, True):.0f} = {sh[1]:.4g} backward"
                + ("" if unmasked else "; no causal figure on A100: the unmasked curve"))
    return f"{what}: {sh[0]:.4g} / {sh[1]:.4g}"
