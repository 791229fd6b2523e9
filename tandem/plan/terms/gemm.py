"""Size-dependent GEMM speed: a roofline over a transformer layer's linear layers.

A GEMM of (M x K) by (K x N) does 2*M*N*K FLOPs and moves at least e*(M*K + K*N + M*N) bytes (e bytes per
element); it runs at max(FLOPs / R, bytes / BW) with R the sustained FLOP/s and BW the memory bandwidth.
Below R/BW FLOPs per byte (NVIDIA's "ops:byte ratio", *Matrix Multiplication Background User's Guide*,
"Math and Memory Bounds") a GEMM is memory-bound. Training shapes of large models are far above it
(GPT-3 175B at tp 8: ~1,500 FLOP/B vs an A100's 77 at half of peak); small hidden sizes, short sequences
and micro-batch 1 are not. Backward's two GEMMs per layer (input and weight gradients) touch the same
three matrices, so one factor covers forward and backward. Attention's QK^T and AV (fused kernels) are
not in this term.
"""

from __future__ import annotations

import math
from functools import lru_cache

from tandem.plan.inputs.model import GPTShape


def _gemms(shape: tuple, tp: int, M: int) -> list[tuple[int, int, int, int]]:
    """(M, K, N, count per model) of one forward: per layer QKV, output projection, MLP in and out (with
    sequence parallelism M is all tokens of the micro-batch), and the logits once."""
    L, h, kv, ffn, gated, vocab = shape
    up = (2 if gated else 1) * ffn // tp
    return [(M, h, (h + 2 * kv) // tp, L), (M, h // tp, h, L), (M, h, up, L), (M, ffn // tp, h, L),
            (M, h, vocab // tp, 1)]


# ---- Tile and wave quantization: a compute-bound GEMM's speed still depends on its shape.
# Measured BF16 GEMM throughput on an H100 SXM (TFLOP/s, M = 2 x 4096 rows, N columns, K reduction) from
# OpenXLA's cost-model table (tensorflow/tensorflow third_party/xla/xla/service/gpu/model/
# matmul_interpolator_data.h, "sm_90", bf16xbf16->bf16, b: 2, m: 4096): rows N, columns K.
_SIZES = (256, 512, 1024, 2048, 4096)
_BF16_H100 = ((135, 235, 366, 508, 584),    # N 256
              (211, 341, 487, 623, 730),    # N 512
              (302, 446, 598, 713, 751),    # N 1024
              (394, 546, 681, 733, 783),    # N 2048
              (464, 608, 693, 763, 808))    # N 4096
# FP8 (e4m3) GEMM throughput on an H800 SXM (same SMs and FP8 peak as an H100 SXM), M = N = 8192, by K:
# tile-ai/tilelang benchmark/matmul_fp8/README.md (256 ... 16384; printed there as 0.376 ... 1.523 with the latency
# in ms, i.e. PFLOP/s). FP8 tiles are twice as deep in K, so a
# small K leaves FP8 further below its peak than BF16: at K 1024 it is 1.34x BF16, at 16384 1.89x.
_FP8_K = (256, 512, 1024, 2048, 4096, 8192, 16384)
_FP8_H800 = (376, 622, 927, 1174, 1378, 1461, 1523)


def _interp(xs: tuple, ys: tuple, x: float) -> float:
    """Piecewise linear in log2(x), clamped to the measured range."""
    x = min(max(x, xs[0]), xs[-1])
    for i in range(len(xs) - 1):
        if x <= xs[i + 1]:
            t = (math.log2(x) - math.log2(xs[i])) / (math.log2(xs[i + 1]) - math.log2(xs[i]))
            return ys[i] + t * (ys[i + 1] - ys[i])
    return ys[-1]


def bf16_share(n: float, k: float) -> float:
    """A GEMM's speed at (N, K) over the largest measured one's (N = K = 4096), BF16 on H100."""
    col = [_interp(_SIZES, row, k) for row in _BF16_H100]
    return _interp(_SIZES, tuple(col), n) / _BF16_H100[-1][-1]


def fp8_gain(k: float) -> float:
    """FP8 GEMM speed at reduction K over its plateau's (K 16384), relative to BF16's at the same K."""
    bf16_k = _interp(_SIZES, _BF16_H100[-1], k) / _BF16_H100[-1][-1]
    return _interp(_FP8_K, _FP8_H800, k) / _FP8_H800[-1] / bf16_k


def _linear_share(K: int, N: int, fp8: bool) -> float:
    """Forward (reduce K), input gradient (reduce N) and weight gradient (reduce the tokens: large) of one
    linear layer: the share of the large-shape rate its three GEMMs keep together."""
    parts = ((N, K, K), (K, N, N), (min(K, N), 4096, 16384))   # (N, K, the K FP8's gain is read at)
    return 3 / sum(1 / (bf16_share(n, k) * (fp8_gain(k8) if fp8 else 1.0)) for n, k, k8 in parts)


def linear_factor(g: GPTShape, tp: int, micro_batch: int, elt_bytes: float, rate: float, mem_Bps: float,
                  fp8: bool = False, tiles: bool = True) -> tuple[float, float, float]:
    """(combined, roofline alone, tile share alone) of ``rate`` the linear layers keep. Combined per GEMM:
    sum(FLOPs) / sum(max(FLOPs / tile share, bytes x rate/BW)): the tile factor slows compute-bound GEMMs only,
    a memory-bound one runs at the bandwidth whatever its tiles (``tiles`` False: share 1, e.g. a CPU)."""
    shape = (g.layers, g.hidden, g.kv_dim, g.ffn, g.gated, g.vocab)
    ridge = rate / mem_Bps if mem_Bps > 0 and rate > 0 else 0.0
    return _combined(shape, tp, micro_batch * g.seq, elt_bytes, ridge, fp8, tiles)


@lru_cache(maxsize=4096)
def _combined(shape: tuple, tp: int, tokens: int, elt_bytes: float, ridge: float, fp8: bool, tiles: bool):
    flops = slow = roof = tile = 0.0
    for M, K, N, n in _gemms(shape, tp, tokens):
        f = 2.0 * M * N * K
        share = _linear_share(K, N, fp8) if tiles else 1.0
        mem = elt_bytes * (M * K + K * N + M * N) * ridge
        flops += n * f
        slow += n * max(f / share, mem)
        roof += n * max(f, mem)
        tile += n * f / share
    if not slow:
        return 1.0, 1.0, 1.0
    return flops / slow, flops / roof, flops / tile


def shape_factor(g: GPTShape, tp: int, fp8: bool = False) -> float:
    """Share of the large-shape linear rate a transformer's linear layers keep at their (tp-split) shapes."""
    return _shape_factor((g.layers, g.hidden, g.kv_dim, g.ffn, g.gated, g.vocab), tp, fp8)


@lru_cache(maxsize=4096)
def _shape_factor(shape: tuple, tp: int, fp8: bool) -> float:
    flops = slow = 0.0
    for M, K, N, n in _gemms(shape, tp, 1):
        f = n * K * N
        flops += f
        slow += f / _linear_share(K, N, fp8)
    return flops / slow if slow else 1.0


def fp8_cast_bytes(g: GPTShape, tp: int, tokens: int, moe=None, ep: int = 1) -> tuple[float, float]:
    """Bytes one GPU's FP8 casts move, as Transformer Engine runs them (delayed scaling: the amax comes out of
    the cast kernel itself, its scale from earlier steps): (per micro-batch, per step). Each linear layer's
    input and output gradient are read in BF16 (2 B) and written in FP8 twice, as is and transposed for the
    weight-gradient GEMM (Hopper's FP8 tensor cores take only the TN layout): 4 B an element, every
    micro-batch; the weights likewise, once a step (TE casts them on the first micro-batch and keeps the FP8
    copy: ``is_first_microbatch``). With tensor (and sequence) parallelism each rank casts its 1/tp share.
    MoE (``moe``): each token's MLP casts run in its top_k routed (x capacity factor) and shared experts, and a
    rank casts the weights of its experts / ep routed experts and the shared ones."""
    act = wt = 0.0
    gemms = _gemms((g.layers, g.hidden, g.kv_dim, g.ffn, g.gated, g.vocab), 1, tokens)
    if moe is not None:
        b = moe.base
        gemms = _gemms((b.layers, b.hidden, b.kv_dim, b.ffn, b.gated, b.vocab), 1, tokens)
        mlp_act = moe.top_k * moe.capacity_factor + moe.shared
        mlp_wt = moe.experts / ep + moe.shared
        Lm, Ld = moe.moe_layers, b.layers - moe.moe_layers
        up = (2 if b.gated else 1) * moe.expert_ffn
        h = b.hidden
        ex = [(tokens, h, up, Lm), (tokens, moe.expert_ffn, h, Lm)]
        for M, K, N, n in ex:
            act += n * mlp_act * FP8_CAST_BYTES * M * (K + N)
            wt += n * mlp_wt * FP8_CAST_BYTES * K * N
        gemms = gemms[:2] + [(M, K, N, Ld) for M, K, N, _ in gemms[2:4]] + gemms[4:]
    for M, K, N, n in gemms:
        act += n * FP8_CAST_BYTES * M * (K + N)
        wt += n * FP8_CAST_BYTES * K * N
    return act / tp, wt / tp


FP8_CAST_BYTES = 4
