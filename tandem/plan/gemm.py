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

from functools import lru_cache

from tandem.plan.model import GPTShape


def linear_gemms(g: GPTShape, tp: int, tokens: int) -> list[tuple[int, int, int, int]]:
    """(M, K, N, count per model) of one forward: per layer QKV, output projection, MLP in and out (with
    sequence parallelism M is all tokens of the micro-batch), and the logits once."""
    return _gemms((g.layers, g.hidden, g.kv_dim, g.ffn, g.gated, g.vocab), tp, tokens)


def _gemms(shape: tuple, tp: int, M: int) -> list[tuple[int, int, int, int]]:
    L, h, kv, ffn, gated, vocab = shape
    up = (2 if gated else 1) * ffn // tp
    return [(M, h, (h + 2 * kv) // tp, L), (M, h // tp, h, L), (M, h, up, L), (M, ffn // tp, h, L),
            (M, h, vocab // tp, 1)]


def roofline(g: GPTShape, tp: int, micro_batch: int, elt_bytes: float, rate: float, mem_Bps: float) -> float:
    """Sustained share of ``rate`` the linear layers keep: sum(FLOPs) / sum(max(FLOPs, bytes x rate/BW))."""
    if mem_Bps <= 0 or rate <= 0:
        return 1.0
    shape = (g.layers, g.hidden, g.kv_dim, g.ffn, g.gated, g.vocab)
    return _roofline(shape, tp, micro_batch * g.seq, elt_bytes, rate / mem_Bps)


@lru_cache(maxsize=4096)   # the search asks for the same shapes thousands of times
def _roofline(shape: tuple, tp: int, tokens: int, elt_bytes: float, ridge: float) -> float:
    flops = slow = 0.0
    for M, K, N, n in _gemms(shape, tp, tokens):
        f = 2.0 * M * N * K
        b = elt_bytes * (M * K + K * N + M * N)
        flops += n * f
        slow += n * max(f, b * ridge)
    return flops / slow if slow else 1.0
