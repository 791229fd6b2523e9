"""explain[] sentences for the communication terms, with their arithmetic: each collective's time (ring, tree,
NVLS, PAT and NCCL's protocols), what of it the framework hides (buckets, prefetch, FSDP blocks, --tp-overlap,
--overlap-p2p), ring attention's K/V exchange and MoE token routing, and the parameter all-gathers' bytes per
parameter (training.Training.gather_bytes)."""

from __future__ import annotations

import math

from tandem.plan.cost import Plan
from tandem.plan.explain_compute import ring_blocks
from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.runtime import RUNTIMES
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.collectives import TREE_BW, Group
from tandem.plan.terms.context import MERGE_KV, MERGE_Q, kv_width
from tandem.plan.terms.grad_sync import deferred, reductions
from tandem.plan.terms.nccl_algos import BASE_US, NVLS_SHARE, NVLS_US, PROTO_SHARE, hop_latency, hw_kind
from tandem.plan.terms.params import expert_states, stage_psi
from tandem.plan.terms.pipeline import steady_pairs
from tandem.plan.terms.tensor_parallel import RS_SPLITS, ring_parts
from tandem.plan.units import ms, si

GATHERS = ("dp-params", "fsdp-params", "ep-params")


def gather_note(p: Plan, o) -> str:
    """' (N parameters x B B: why)' for a ZeRO/FSDP parameter all-gather: the parameters gathered (the stage's,
    per tp rank; an MoE model's experts for ep-params) times the bytes each moves; '' for other operations."""
    if o.name not in GATHERS:
        return ""
    m, s, t = p.model, p.strategy, p.training
    if o.name == "ep-params":
        psi = expert_states(m, s, t)[1]
    else:
        psi = stage_psi(m, s, t)
    pb = t.gather_bytes
    if t.autocast:
        why = (": fp32, the weights as stored: tandem's trainer keeps them in fp32 under autocast and its FSDP2 "
               "has no MixedPrecisionPolicy")
    else:
        why = f": the {'bf16' if t.precision == 'fp8' else t.precision} working weights" if pb != 4 else ""
    return f" ({si(psi, '')} parameters x {pb} B{why})"


# what a collective's name does not say on its own
WHY = {"embedding-grad": " (the tied word embedding's gradient: its copies on the first and the last pipeline stage "
                         "summed once a step after the last backward, in the data-parallel reduction's dtype; "
                         "Megatron-LM's allreduce_word_embedding_grads)"}


def p2p_sentence(o, p: int, v: int, mb: int) -> str:
    """The exposed part of the pipeline's sends under --overlap-p2p, with its arithmetic (pipeline.py)."""
    one = o.time_s / max(1, o.calls)
    return (f"posted async and waited before use (--overlap-p2p, Megatron-core's overlap_p2p_comm): the fill and "
            f"drain's 2 x ({p} x {v} - 1) = {2 * (p * v - 1)} sends stay on the critical path, the "
            f"{steady_pairs(p, v, mb)} steady 1F1B pairs' sends hide behind their chunks up to the chunk's time "
            f"(forward {ms(o.window_s)}, backward {ms(2 * o.window_s)}; {ms(one)} a send): {ms(o.exposed_s)} of "
            f"{ms(o.time_s)} exposed.")


def _cp_ep_sentence(p: Plan, o) -> str:
    """Ring attention's K/V passing and MoE token routing, with their arithmetic (context.py, expert.py)."""
    c, s, g = p.cluster, p.strategy, p.model.gpt
    link = f"{o.link} ({'crosses nodes' if o.group.crosses_nodes else 'inside a node'})"
    if o.name == "cp-ring":
        return cp_sentence(p, o, link)
    per, calls = o.detail
    moe = p.model.moe
    tokens = g.seq / (s.cp * s.tp)   # per sequence: the b before it is the micro-batch
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
    if deferred(t, s):
        return ("FSDP2's reduce_dtype, float32 in torchtitan's mixed-precision policy (mixed_precision_reduce), "
                "as torch's pipelining runs it")
    return "Megatron-LM's distributed optimizer reduces BF16 gradients in FP32, accumulate_allreduce_grads_in_fp32"


def comm_sentence(p: Plan, o) -> str:
    if o.name in ("cp-ring", "ep-all-to-all"):
        return _cp_ep_sentence(p, o)
    c = p.cluster
    g = o.group
    per = o.time_s / max(1, o.calls)
    unit = ("buckets" if o.rule in ("buckets", "prefetch") else "bucket calls" if o.name.startswith("dp-") else
            "calls")   # a deferred reduce-scatter (rule none) still runs in its buckets
    chunked = f" in {o.chunks} {unit}" if o.chunks > 1 else ""
    head = (f"{o.name}: {o.collective} of {si(o.bytes)}{gather_note(p, o)} x {o.calls} call(s) per step{chunked} "
            f"over {g.size} GPUs, {describe(g, c)}{WHY.get(o.name, '')}")
    algo, _, proto = o.algorithm.partition("/")
    how = (f" with NCCL's {proto} protocol ({proto_note(proto)})" if proto else "")
    if o.collective == "all_reduce" and algo == "nvls":
        return (f"{head}: NVLink SHARP (nvls: the switch reduces; each GPU sends {si(o.bytes / o.chunks)} once and "
                f"reads the sum once) {si(o.bytes / o.chunks)} / ({NVLS_SHARE:.3g} x "
                f"{si(c.intra.bandwidth_Bps, 'B/s')}) + {NVLS_US:g} us = {ms(per / max(1, o.chunks))} per call"
                + (f", x {o.calls * max(1, o.chunks)} = {ms(o.time_s)} per step" if o.calls * max(1, o.chunks) > 1
                   else ""))
    if algo == "pat":
        return (f"{head}: PAT (NCCL's parallel aggregated trees, one GPU per node: the ring's bytes, "
                f"log2({g.nodes}) network hops instead of {g.nodes}-1) = {ms(per)} per "
                + ("step" if o.calls == 1 else f"call, x {o.calls} = {ms(o.time_s)} per step"))
    if o.collective == "all_reduce" and g.nodes > 1 and algo == "tree":
        nn, l = g.nodes, g.local
        p_ = proto or "Simple"
        share = f" x {PROTO_SHARE[p_]:.3g}" if proto else ""
        a_in = hop_latency(c.intra.latency_s, "tree", hw_kind(c.intra.name), p_) if l > 1 else 0.0
        a_out = hop_latency(c.inter.latency_s, "tree", "net", p_)
        base = BASE_US[("tree", p_)]
        return (f"{head}: NCCL-style tree{how} (its latency grows with log2 of the nodes; the ring's 2x({nn}-1) "
                f"steps per call cost more at {si(o.bytes / o.chunks)} per call): 2 x {si(o.bytes / o.chunks)}"
                f"{f' / {l}' if l > 1 else ''} / ({TREE_BW}{share} x {si(c.node_rate_Bps / c.gpus_per_node, 'B/s')}"
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
        return (f"{head}: ring 2x({n}-1)/{n} x {si(o.bytes)} / {si(c.intra.rate_Bps, 'B/s')} + latency "
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
    if deferred(t, s) and p.model.moe is None:
        return _deferred_rule(t, s, p.grad_accum)
    if s.zero <= 2:
        gather = ("during the next forward (--overlap-param-gather, Megatron)" if t.overlap_param_gather
                  else "after the step, exposed (--overlap-param-gather to hide it as Megatron does)")
        return (f"as ZeRO-{s.zero}: gradient buckets reduce-scattered during backward, the last exposed; "
                f"parameter all-gather {gather}")
    if not RUNTIMES[t.runtime].zero3_prefetch:
        return (f"as {t.runtime}'s ZeRO-3: each module's all-gather waited for in its own forward/backward hook, "
                "exposed; reduce-scatter during backward, the last exposed")
    return ("as FSDP: each block's all-gather prefetched during the previous block's forward/backward, "
            "reduce-scatter during backward; first gather and last reduce-scatter exposed")


def exposed_sentence(o, p: Plan) -> str:
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
        return tp_sentence(o, o.group.size)
    if o.rule == "pp-async":
        return p2p_sentence(o, p.strategy.pp, p.strategy.virtual, p.grad_accum)
    if o.rule == "manual":
        return f"--overlap hides part of {ms(o.window_s * o.calls)}: {ms(o.exposed_s)} of it exposed."
    return f"{ms(o.exposed_s)} of it exposed."


def _deferred_rule(t: Training, s: Strategy, mb: int) -> str:
    """The overlap rule when grad_sync.deferred ("once a round" only where there are rounds: interleaved)."""
    return (f"as FSDP under torch's pipelining (pp_grad_sync {t.pp_grad_sync}): gradients accumulated unsharded "
            f"and reduce-scattered once a {'round' if reductions(t, s, mb) > 1 else 'step'}, exposed; "
            "parameters gathered once, behind the first forward")


def cp_sentence(p: Plan, o, link: str) -> str:
    """Ring attention: the K/V passing (Megatron's p2p ring, or torch's all-gather), the ring's shorter attention
    kernels and torch's fp32 merges (context.py)."""
    s, g, t = p.strategy, p.model.gpt, p.training
    sf, sb, bf, bb, passes, impl = o.detail
    chunk = g.seq // s.cp
    layers = o.calls // max(1, (passes + 1) * (1 if impl == "allgather" else s.cp - 1) * p.grad_accum)
    kvw = kv_width(g, s.tp, t.kv_repeat)
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
                f"{ring_blocks(p, impl)}")
    else:
        body = (f"; per layer and micro-batch {s.cp - 1} steps pass them ({ms(sf)} a step forward, {ms(sb)} backward "
                f"with dK, dV), each behind one block's attention, 4 x b x (s/cp)^2 x h/tp FLOPs = {ms(bf)} forward, "
                f"{ms(bb)} backward: exposed = steps x (max(0, {ms(sf)} - {ms(bf)}){rc} + max(0, {ms(sb)} - "
                f"{ms(bb)}))")
    blocks = ring_blocks(p, impl)
    merge = (f"; torch merges the partial outputs in eager fp32 ops: (cp-1) x layers x micro-batches x ({passes} x "
             f"({MERGE_Q[0]} B x b s/cp h/tp + {MERGE_KV[0]} B x 2 b s/cp kv) + {MERGE_Q[1]} B x "
             f"b s/cp h/tp + {MERGE_KV[1]} B x 2 b s/cp kv) / {si(p.cluster.gpu.memory_Bps, 'B/s')} HBM = "
             f"{ms(p.cp_merge_s)} of compute" if p.cp_merge_s else "")
    # torch's body already counts the steps inside each layer's term; the p2p ring's is per step
    over = f" x {layers} layers" if impl == "torch" else f" over {s.cp - 1} steps x {layers} layers"
    return (f"{head}{body}{over} x {p.grad_accum} micro-batches = {ms(o.exposed_s)} of {ms(o.time_s)}"
            f"{blocks}{merge}")


def tp_sentence(o, tp: int) -> str:
    """The exposed part of the tensor-parallel collectives with its arithmetic (tensor_parallel.py)."""
    one, (qkv, proj, fc1, fc2), layers, mb, full = o.detail
    per = o.exposed_s / max(1, layers * mb)
    h = one / 2
    if o.rule == "tp-bulk":
        return (f"dgrad reduce-scatter beside the wgrad GEMM (Transformer Engine, bulk or async NCCL): forward "
                f"exposed ({2 * (2 if full else 1)} x {ms(one)}); in "
                f"backward the all-gather {ms(h)} exposed and each dgrad reduce-scatter {ms(h)} beside its wgrad GEMM "
                f"(QKV {ms(qkv)}, FC1 {ms(fc1)}): + {ms(h)} + max(0, {ms(h)} - {ms(qkv)}) + {ms(h)} + max(0, "
                f"{ms(h)} - {ms(fc1)}) = {ms(per)} per layer, x {layers} layers x {mb} micro-batches = "
                f"{ms(o.exposed_s)} exposed.")
    fa, fm, ba, bm = ring_parts(one, tp, (qkv, proj, fc1, fc2))
    return (f"Transformer Engine's overlaps, all-gather a and reduce-scatter a = {ms(h)} per all-reduce, GEMMs G "
            f"per micro-batch QKV {ms(qkv)}, proj {ms(proj)}, FC1 {ms(fc1)}, FC2 {ms(fc2)}: forward gather ring-"
            f"exchanged max(0, a - G_col x ({tp}-1)/{tp}) + scatter in {RS_SPLITS} splits max(a/{RS_SPLITS}, a - G_row x "
            f"{RS_SPLITS - 1}/{RS_SPLITS}) = attention {ms(fa)} + MLP {ms(fm)}{' (x 2, recompute)' if full else ''}; "
            f"backward gather max(0, a - G_row x ({tp}-1)/{tp}) + dgrad scatter beside the wgrad max(0, a - G_col) = "
            f"{ms(ba)} + {ms(bm)}; {ms(per)} per layer, x {layers} layers x {mb} micro-batches = {ms(o.exposed_s)} "
            f"exposed.")


def _rate(link, per: str, nics: int = 1) -> str:
    """'370 GB/s per GPU (nccl-tests busbw; datasheet 450)', or the datasheet rate alone."""
    r = f"{link.rate_Bps * nics / 1e9:.4g} GB/s per {per}"
    return f"{r} (nccl-tests busbw; datasheet {link.bandwidth_Bps * nics / 1e9:.4g})" if link.busbw_Bps else r


def describe(g: Group, c: Cluster) -> str:
    """Where the group's GPUs are (the algorithm is named with the time: sentence())."""
    if g.nodes == 1:
        return f"inside a node on {c.intra.name} ({_rate(c.intra, 'GPU')})"
    net = f"{c.inter.name} ({_rate(c.inter, 'node', c.nics_per_node)})"
    if g.local == 1:
        return f"one GPU per node across {g.nodes} nodes on {net}"
    return (f"hierarchical: {g.local} GPUs per node on {c.intra.name}, then {g.nodes} nodes on {net}")
