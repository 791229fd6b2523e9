"""Context parallelism (ring attention) as the frameworks run it: the K/V exchange, the ring's shorter attention
blocks, and torch's ``context_parallel`` (what torchtitan runs) next to Megatron-core / Transformer Engine's p2p
ring (``cp_comm``).

**The ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron-core's
``context_parallel_size``): the sequence is split in ``cp`` chunks (load-balanced for causal masks), each GPU holds
s/cp tokens' activations (Korthikanti et al.'s per-layer formula at s/cp). Per layer and micro-batch the K and V
chunks go around the ring: cp-1 steps of 2 x b x s/cp x kv_dim values in the forward, twice that in the backward
(K, V and their gradients), each step hidden behind one block's attention (4 x b x (s/cp)^2 x h FLOPs forward,
twice backward): exposed = (cp-1) x max(0, send - block compute).

**Block length.** Under cp each GPU runs attention as one kernel per ring step on blocks shorter than the
sequence: load-balanced causal ring attention (Megatron-core, torch) cuts the sequence in 2 x cp chunks, so a
step pairs s/cp queries with s/(2 cp) keys or the reverse; the planner takes the geometric mean,
s / (cp x sqrt 2). Fused attention kernels are slower on short sequences: Shah et al. 2024 (FlashAttention-3,
arXiv:2407.08608), figures "Attention forward speed" and "Attention backward speed", head dim 128 (H100 80GB
SXM5), batch x length = 16k tokens (attention_kernels.py, TFLOP/s). These curves are the attention-kernel
model's (efficiency.py: absolute share of peak by kernel and length, forward and backward apart); under cp it
reads them at the block length, with the kernel each implementation runs: Transformer Engine's fused attention
is cuDNN's; torch's context_parallel runs SDPA's flash or memory-efficient backend only (torchtitan's train
context: ``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])``, "currently we only support these two SDP
backends"), and PyTorch's flash backend is FlashAttention-2.

**torch's context_parallel** (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``,
torch 2.13; torchtitan's default ``context_parallel_rotate_method = "allgather"``):
- forward: K and V are all-gathered once, issued before the first (local, causal) block and waited for at
  the second: exposed = max(0, all-gather - one block);
- backward: K and V all-gathered again (the same rotater), and dK, dV passed around the ring in fp32 (the
  accumulation dtype): cp - 1 sends of 2 x the bf16 K/V bytes, each behind one block's backward;
- the partial outputs are merged in eager fp32 element-wise ops (``_SDPAMerger``, ``_partial_update``), on the
  compute stream and bound by HBM: per ring step and output element (b x s/cp x h/tp) forward: bf16 to fp32
  copy (6 B), out - block_out (12 B), x sigmoid(lse diff) (8 B), out - that (12 B), and on half the steps a
  chunk-and-cat of the output (8 B, so 4 B on average): 42 B; backward: grad_q += block grad_q in fp32 (10 B)
  + half the steps' partial update (6 B on average): 16 B. Per element of K or V (b x s/cp x kv width):
  forward 4 B (K, V flattened and concatenated for the send), backward 26 B (dK += in fp32 10 B, partial
  update 4 B on average, the fp32 concatenation for the send 8 B, the K/V concatenation 4 B). Extra kernel
  launches per step (tens of microseconds against milliseconds of attention a step) are left out;
- the backward's last dK/dV send is waited for after its loop: exposed whole.

**The diagonal step** (``diagonal_fraction``): 1/cp of a GPU's ring FLOPs are step 0's causal block on s/cp
tokens, at the kernel's causal speed (torch and Transformer Engine alike). **K/V repeated** to the query heads
(``kv_width(repeat=True)``): torchtitan's Llama at its Dec 2024 report calls ``repeat_kv`` before SDPA, so the
ring moves and merges h/tp values a token. **Meta's all-gather CP** (``allgather_cp``, Llama 3 paper section
3.3.2): K/V all-gathered per layer, exposed, and dK/dV reduce-scattered back, exposed.

**Load balancing is assumed on**, as torch runs it by default: ``_ContextParallelOptions.enable_load_balance =
True`` in torch 2.6.0's ``_attention.py`` (the release around the torchtitan report's torch commit of
2024-12-23) with the head-tail ``_RoundRobinLoadBalancer`` (rank r holds chunks r and 2cp-1-r), still the default
in torch 2.13's ``context_parallel`` (``_create_default_load_balancer``: head-tail when 2 x cp divides the
sequence, else sequential sharding, which the planner refuses: ``cost.check``). Without it
(``_is_causal_behavior``: SKIP for later ranks' K/V) the last rank would run cp-1 full blocks and the diagonal,
(2cp-1)/cp of the balanced work; torchtitan 9dec370 calls ``context_parallel`` without changing the option.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.model import GPTShape
from tandem.plan.terms.collectives import collective, layout, link_name


KERNEL = {"megatron": "cudnn", "torch": "fa2", "allgather": "cudnn"}


# torch's merges: HBM bytes per element per ring step (forward, backward), output elements and K/V elements
MERGE_Q = (42, 16)


MERGE_KV = (4, 26)


def block_length(seq: int, cp: int) -> float:
    return seq / (cp * math.sqrt(2))


def diagonal_fraction(cp: int, impl: str) -> float:
    """Share of a GPU's ring attention FLOPs in the diagonal step's causal block. Both p2p rings (torch's
    ``_templated_ring_attention``: step i = 0 runs SDPA with ``is_causal=True`` on both local chunks; Transformer
    Engine's ``AttnFuncWithCPAndKVP2P``: step 0 with the causal mask) split the causal work in cp steps of equal
    area (2 (s/2cp)^2 each: the diagonal's causal half of its (s/cp)^2 square, every other step a full
    (s/cp) x (s/2cp) rectangle), so 1/cp of it runs masked, at the kernel's causal speed on s/cp tokens. Meta's
    all-gather CP (``allgather``) runs each local query chunk once against the gathered prefix: no diagonal step."""
    return 1.0 / cp if cp > 1 and impl in ("megatron", "torch") else 0.0


def kv_width(g, tp: int, repeat: bool = False) -> int:
    """K (or V) values per token on one GPU: kv heads split by tp, one head each when tp exceeds them; ``repeat``:
    the model repeats them to the query heads before attention (torchtitan's Llama at the commit of its Dec 2024
    performance report, 9dec370: ``repeat_kv`` then SDPA, so torch's ring moves and merges h/tp values)."""
    return g.hidden // tp if repeat else g.kv_dim // min(tp, g.kv_heads)


def merge_s(g, s, layers: float, micro_batches: int, memory_Bps: float, repeat: bool = False) -> float:
    """torch's eager fp32 merges of one step on one GPU: (cp-1) ring steps x layers x micro-batches."""
    tokens = s.micro_batch * g.seq / s.cp
    q, kv = tokens * g.hidden / s.tp, 2 * tokens * kv_width(g, s.tp, repeat)
    passes = 2 if s.recompute == "full" else 1
    per_step = passes * (MERGE_Q[0] * q + MERGE_KV[0] * kv) + MERGE_Q[1] * q + MERGE_KV[1] * kv
    return (s.cp - 1) * layers * micro_batches * per_step / memory_Bps


def torch_ring(kv: float, cp: int, link: tuple[float, float], block_f: float, block_b: float, layers: int,
               fwd_passes: int) -> dict:
    """torch's all-gather rotation of one micro-batch on one GPU over ``layers`` layers: ``kv`` the bf16 K and V
    bytes of one chunk, ``link`` (bytes/s, latency), ``block_f``/``block_b`` one block's attention. The backward
    sends dK, dV at the end of every one of its cp steps (``dkv_rotater.exchange_buffers`` in the loop) and waits
    for the last after the loop, with no block left to hide it (``dkv_rotater.next_buffer()`` before returning)."""
    gather = (cp - 1) * (kv / link[0] + link[1])              # (cp-1) chunks arrive, ring all-gather
    dkv = 2 * kv / link[0] + link[1]                          # dK, dV in fp32: twice the bf16 bytes
    time = layers * (fwd_passes * gather + gather + cp * dkv)
    exposed = layers * (fwd_passes * max(0.0, gather - block_f) + max(0.0, gather - block_b)
                        + (cp - 1) * max(0.0, dkv - block_b) + dkv)
    return {"time_s": time, "exposed_s": exposed, "send_f": gather, "send_b": dkv}


def allgather_cp(kv: float, cp: int, gather_s: float, scatter_s: float, layers: int, fwd_passes: int) -> dict:
    """Meta's all-gather CP (Llama 3 paper, section 3.3.2): each layer all-gathers the cp chunks' K and V, then
    computes attention of the local query chunks; "the all-gather communication latency is exposed in the
    critical path". The backward reduce-scatters dK, dV back to their chunks (the all-gather's adjoint) before
    the K/V projections' backward can use them: exposed too. ``gather_s``/``scatter_s`` one call's time."""
    return {"time_s": layers * (fwd_passes * gather_s + scatter_s),
            "exposed_s": layers * (fwd_passes * gather_s + scatter_s), "send_f": gather_s, "send_b": scatter_s}


def cp_attention(attn_s: float, g, s, c, impl: str, micro_batches: int, repeat: bool = False) -> tuple[float, float]:
    """(attention seconds, torch's merge seconds) of one step on one GPU. The blocks' shorter length is already in
    ``attn_s`` (efficiency.attention_times reads the kernel's curve at block_length under cp)."""
    if s.cp <= 1:
        return attn_s, 0.0
    merge = merge_s(g, s, g.layers / s.pp, micro_batches, c.gpu.memory_Bps, repeat) if impl == "torch" else 0.0
    return attn_s, merge


def cp_comm(g: GPTShape, micro_batch: int, cp: int, act_bytes: int, block_rate: float, c: Cluster,
            crosses_nodes: bool = False, fwd_passes: int = 1, tp: int = 1, impl: str = "megatron",
            kv_repeat: bool = False) -> dict:
    """Ring attention's K/V passing for one micro-batch on one GPU over all layers, and what the
    blocks' attention compute (at ``block_rate`` FLOP/s) leaves exposed; per GPU, tp splitting the heads
    (``impl`` "torch": torch's all-gather rotation, ``torch_ring``)."""
    if cp <= 1:
        return {"bytes_per_step": 0.0, "steps": 0, "time_s": 0.0, "exposed_s": 0.0}
    chunk = g.seq / cp
    kv = 2 * micro_batch * chunk * kv_width(g, tp, kv_repeat) * act_bytes   # K and V of one chunk, this GPU
    link = (c.node_rate_Bps / c.gpus_per_node, c.inter.latency_s) if crosses_nodes else \
        (c.intra.rate_Bps, c.intra.latency_s)
    block_f = 4 * micro_batch * chunk * chunk * g.hidden / tp / block_rate
    block_b = 2 * block_f
    steps = (cp - 1) * g.layers
    if impl == "torch":
        r = torch_ring(kv, cp, link, block_f, block_b, g.layers, fwd_passes)
        return {"bytes_per_step": kv, "steps": steps, **r, "block_f": block_f, "block_b": block_b}
    if impl == "allgather":   # one all-gather of the cp chunks forward, one reduce-scatter of dK, dV backward
        grp = layout(cp, tp, c.gpus_per_node)
        r = allgather_cp(kv, cp, collective("all_gather", cp * kv, 1, grp, c)[0],
                              collective("reduce_scatter", cp * kv, 1, grp, c)[0], g.layers, fwd_passes)
        return {"bytes_per_step": kv, "steps": g.layers, **r, "block_f": block_f, "block_b": block_b}
    send_f = kv / link[0] + link[1]
    send_b = 2 * kv / link[0] + link[1]                           # K, V and dK, dV
    return {"bytes_per_step": kv, "steps": steps, "time_s": steps * (fwd_passes * send_f + send_b),
            "exposed_s": steps * (fwd_passes * max(0.0, send_f - block_f) + max(0.0, send_b - block_b)),
            "send_f": send_f, "send_b": send_b, "block_f": block_f, "block_b": block_b}


def cp_shape(g: GPTShape, cp: int) -> GPTShape:
    """The shape one GPU's activations follow under cp: s/cp tokens (memory.gpt_layer_act_bytes on it)."""
    if g.seq % cp:
        raise ValueError(f"cp {cp} must divide the sequence {g.seq}")
    return replace(g, seq=g.seq // cp)


def min_chunk_for_overlap(g: GPTShape, act_bytes: int, rate: float, bandwidth: float) -> float:
    """Tokens per GPU above which the forward K/V send hides behind a block's attention:
    4 b c^2 h / rate >= 2 b c kv act / B  <=>  c >= rate x kv x act / (2 h B)."""
    return rate * g.kv_dim * act_bytes / (2 * g.hidden * bandwidth)


def cp_op(m, c: Cluster, s, by: dict, mb: int, stage_layers: int, attn_rate: float, recompute: str,
          impl: str = "megatron", kv_repeat: bool = False) -> dict:
    """Ring attention's K/V exchange of one step on the slowest stage's GPU, as CommOp fields: every micro-batch,
    every layer the stage holds; with full recompute the forward's share runs twice. ``attn_rate``: attention's
    FLOP/s at the ring's block length (efficiency.attention_rate)."""
    fwd_passes = 2 if recompute == "full" else 1
    grp = layout(s.cp, s.tp, c.gpus_per_node)
    r = cp_comm(replace(m.gpt, layers=stage_layers), s.micro_batch, s.cp, by["act"], attn_rate, c,
                grp.crosses_nodes, fwd_passes, s.tp, impl, kv_repeat)
    # bytes per call as the JSON counts them (collectives.all_gather's convention, nccl-tests' size): one chunk per
    # send of the p2p rings; the gathered K/V of all cp chunks (the reduce-scatter's input) for all-gather CP
    return dict(name="cp-ring", collective="all_gather" if impl == "allgather" else "send_recv",
                bytes=r["bytes_per_step"] * (s.cp if impl == "allgather" else 1),
                calls=r["steps"] * mb * (fwd_passes + 1), group=grp,
                link=link_name(grp, c), time_s=r["time_s"] * mb, exposed_s=r["exposed_s"] * mb,
                rule="none" if impl == "allgather" else "ring-attention",
                algorithm=(collective("all_gather", s.cp * r["bytes_per_step"], 1, grp, c)[1] if impl == "allgather"
                           else "p2p"),
                window_s=r["block_f"], detail=(r["send_f"], r["send_b"], r["block_f"], r["block_b"],
                                               fwd_passes, impl))
