"""Ring attention (context parallelism) as the frameworks run it: the attention kernel's speed on the ring's
blocks, and torch's ``context_parallel`` (what torchtitan runs) next to Megatron-core / Transformer Engine's
p2p ring (``moe_cp.cp_comm``).

**Block length.** Under cp each GPU runs attention as one kernel per ring step on blocks shorter than the
sequence: load-balanced causal ring attention (Megatron-core, torch) cuts the sequence in 2 x cp chunks, so a
step pairs s/cp queries with s/(2 cp) keys or the reverse; the planner takes the geometric mean,
s / (cp x sqrt 2). Fused attention kernels are slower on short sequences: Shah et al. 2024 (FlashAttention-3,
arXiv:2407.08608), figures "Attention forward speed" and "Attention backward speed", head dim 128 (H100 80GB
SXM5), batch x length = 16k tokens (``FWD_HD128``, ``BWD_HD128``, TFLOP/s). These curves are the attention-kernel
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

CP_IMPLS = ("megatron", "torch", "allgather")

# Shah et al. 2024, FlashAttention-3 (arXiv:2407.08608), H100 80GB SXM5, head dim 128, batch x length = 16k tokens,
# TFLOP/s as the paper counts them (backward = 2.5 x forward FLOPs): figures "Attention forward speed" and
# "Attention backward speed" (no causal mask). "unfused" is the figure's "Standard attention" (PyTorch, the s x s
# scores in memory; out of memory at 16k: its 8k value held). The attention-kernel model (efficiency.py) reads
# both directions; the ring's block-length factor below the same curves.
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
FWD_HD128 = {"fa2": (309, 350, 362, 368, 370, 370),
             "cudnn": (497, 574, 617, 609, 600, 595),
             "fa3": (467, 565, 625, 638, 646, 648),
             "unfused": (74, 100, 119, 133, 139, 139)}
BWD_HD128 = {"fa2": (214, 260, 291, 310, 318, 322),
             "cudnn": (305, 408, 465, 499, 518, 516),
             "fa3": (316, 424, 501, 542, 559, 561),
             "unfused": (104, 131, 159, 174, 181, 181)}
# The same paper's causal forward figure (head dim 128): TFLOP/s counting the half of the s x s square a causal
# kernel computes. No causal backward figure: backward's causal speed is taken as the non-causal one x forward's
# causal / non-causal ratio at that length (causal_speed).
FWD_CAUSAL_HD128 = {"fa2": (191, 260, 298, 319, 333, 335),
                    "cudnn": (315, 410, 484, 518, 529, 539),
                    "fa3": (292, 423, 521, 579, 602, 616)}
BWD_FLOPS = 2.5   # the papers count backward as 2.5 x forward (recomputed scores); the planner 2 x
KERNEL = {"megatron": "cudnn", "torch": "fa2", "allgather": "cudnn"}
HOPPER = ("h100-sxm", "h100-sxm-500w", "h100-pcie", "h200")

# torch's merges: HBM bytes per element per ring step (forward, backward), output elements and K/V elements
MERGE_Q = (42, 16)
MERGE_KV = (4, 26)


def speed(kernel: str, length: float, backward: bool = False) -> float:
    """The kernel's TFLOP/s at ``length`` tokens (log2-interpolated in the figure, clamped to its range)."""
    ys = (BWD_HD128 if backward else FWD_HD128)[kernel]
    x = min(max(math.log2(max(length, 1)), 9.0), 14.0) - 9.0
    i = min(int(x), 4)
    return ys[i] + (ys[i + 1] - ys[i]) * (x - i)


def causal_speed(kernel: str, length: float, backward: bool = False) -> float:
    """The kernel's TFLOP/s with a causal mask (on the half square it computes): the causal forward figure;
    backward: the non-causal backward x that figure's causal / non-causal ratio."""
    ys = FWD_CAUSAL_HD128[kernel]
    x = min(max(math.log2(max(length, 1)), 9.0), 14.0) - 9.0
    i = min(int(x), 4)
    fwd = ys[i] + (ys[i + 1] - ys[i]) * (x - i)
    return fwd * speed(kernel, length, True) / speed(kernel, length) if backward else fwd


def train_speed(kernel: str, length: float) -> float:
    """Forward + backward TFLOP/s in the planner's count (forward F, backward 2F): 3 / (1/fwd + 2.5/bwd)."""
    return 3 / (1 / speed(kernel, length) + BWD_FLOPS / speed(kernel, length, True))


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


def block_share(gpu: str, impl: str, seq: int, cp: int, kernel: str | None = None) -> float:
    """Speed of the ring's per-step attention kernel over the same kernel on the whole sequence (forward and
    backward together); 1.0 where the GPU has no such figure (efficiency.py's attention model decides)."""
    from tandem.plan import efficiency as E

    k = kernel or KERNEL[impl]
    if cp <= 1 or not E.has_curve(gpu, k):
        return 1.0
    return train_speed(k, block_length(seq, cp)) / train_speed(k, seq)


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
