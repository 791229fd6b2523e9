"""Published attention-kernel speeds by sequence length, the tables every attention term reads.

**FlashAttention-2, FlashAttention-3, cuDNN and unfused attention** (``FWD_HD128``, ``BWD_HD128``,
``FWD_CAUSAL_HD128``): Shah et al. 2024 (FlashAttention-3, arXiv:2407.08608), figures "Attention forward speed" and
"Attention backward speed", head dim 128 (H100 80GB SXM5), batch x length = 16k tokens, TFLOP/s. Fused attention
kernels are slower on short sequences, which is why ring attention's blocks (context.py) read these curves at their
block length. efficiency.py turns them into shares of peak.

**FlashAttention-1 and its Triton kernel** (``--attention-kernel fa1|triton``), as shares of FlashAttention-2's
speed (``over_fa2``).

2023 stacks ran FlashAttention's first generation: MosaicML's llm-foundry (v0.3.0, the MPT benchmarks of
scripts/train/benchmarking/README.md) installs flash-attn 1.0.9 (its ``gpu`` extra; 1.0.7 for the H100 FP8 runs)
and runs ``attn_impl: triton`` (the yamls' and submit_benchmarks.py's default until March 2024): the Triton
FlashAttention of flash-attn 1.x (llmfoundry/models/layers/flash_attn_triton.py, compiled by triton-pre-mlir),
whose header says "Overall Triton forward + backward is slightly slower than CUDA forward + backward".

The only published speeds of those kernels by length are the FlashAttention-2 release's figures (Dao 2023,
arXiv 2307.08691, Figures 4 and 7; flash-attention's assets/flash2_a100_fwd_bwd_benchmark.png and
flash2_h100_fwd_bwd_benchmark.png): forward + backward TFLOP/s, batch x length = 16k tokens, causal panels,
head dim 64 and 128, at 512, 1k, 2k, 4k, 8k, 16k. The planner times FlashAttention-2 from the FlashAttention-3
paper's (H100) and Table 3's (A100) figures (efficiency.py); a first-generation kernel runs at that share x
its own bar / FlashAttention-2's bar in the same panel of the same figure, so the two figure sets never mix
absolute numbers. H100 has no Triton bar (that Triton predates Hopper support): FlashAttention-1's H100 bar x
the A100 figure's Triton / FlashAttention-1 ratio at that length, as the kernel's header says it relates to
the CUDA kernel. Causal panels only (the runs these serve are causal, without context parallelism); head dim
64 and below read the head-dim-64 panel, larger the 128 one.
"""

from __future__ import annotations

import math

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


def interpolate(ys: tuple, length: float) -> float:
    """log2-interpolated in the figure's lengths (512 ... 16k), clamped to them."""
    x = min(max(math.log2(max(length, 1)), 9.0), 14.0) - 9.0
    i = min(int(x), 4)
    return ys[i] + (ys[i + 1] - ys[i]) * (x - i)


def speed(kernel: str, length: float, backward: bool = False) -> float:
    """The kernel's TFLOP/s at ``length`` tokens (log2-interpolated in the figure, clamped to its range)."""
    return interpolate((BWD_HD128 if backward else FWD_HD128)[kernel], length)


def causal_speed(kernel: str, length: float, backward: bool = False) -> float:
    """The kernel's TFLOP/s with a causal mask (on the half square it computes): the causal forward figure;
    backward: the non-causal backward x that figure's causal / non-causal ratio."""
    fwd = interpolate(FWD_CAUSAL_HD128[kernel], length)
    return fwd * speed(kernel, length, True) / speed(kernel, length) if backward else fwd


def train_speed(kernel: str, length: float) -> float:
    """Forward + backward TFLOP/s in the planner's count (forward F, backward 2F): 3 / (1/fwd + 2.5/bwd)."""
    return 3 / (1 / speed(kernel, length) + BWD_FLOPS / speed(kernel, length, True))


# ---- FlashAttention-1 and flash-attn 1.x's Triton kernel



FIRST_GEN = ("fa1", "triton")
FIRST_GEN_SOURCE = {
    "fa1": ("FlashAttention-1 (flash-attn 1.x): FlashAttention-2's share x FlashAttention / FlashAttention-2 in the "
            "FlashAttention-2 paper's forward + backward figures (causal; H100 Fig. 7, A100 Fig. 4)"),
    "triton": ("flash-attn 1.x's Triton FlashAttention (llm-foundry's attn_impl: triton): FlashAttention-1's share x "
               "the FlashAttention-2 paper's A100 Triton / FlashAttention bars (causal, Fig. 4)"),
}
# forward + backward TFLOP/s, causal, at 512, 1k, 2k, 4k, 8k, 16k: {(arch, head dim): {kernel: bars}}
FIG = {
    ("hopper", 64): {"fa1": (104, 123, 136, 138, 149, 156), "fa2": (141, 192, 232, 257, 273, 284)},
    ("hopper", 128): {"fa1": (98, 109, 108, 126, 135, 137), "fa2": (163, 221, 265, 294, 308, 328)},
    ("ampere", 64): {"fa1": (58, 70, 77, 87, 92, 97), "triton": (59, 75, 79, 76, 79, 80),
                     "fa2": (88, 119, 140, 156, 165, 171)},
    ("ampere", 128): {"fa1": (55, 62, 69, 76, 80, 83), "triton": (50, 61, 68, 74, 78, 80),
                      "fa2": (99, 133, 155, 173, 182, 189)},
}


def over_fa2(kernel: str, arch: str, length: float, head_dim: int = 128) -> float:
    """The kernel's forward + backward speed over FlashAttention-2's at ``length`` on ``arch`` (hopper/ampere)."""
    hd = 64 if head_dim <= 64 else 128
    f = FIG[(arch, hd)]
    r = interpolate(f["fa1"], length) / interpolate(f["fa2"], length)
    if kernel == "triton":
        a = FIG[("ampere", hd)]
        r *= interpolate(a["triton"], length) / interpolate(a["fa1"], length)
    return r
