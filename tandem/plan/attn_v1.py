"""FlashAttention-1 and its Triton kernel, as shares of FlashAttention-2's speed (``--attention-kernel fa1|triton``).

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

KERNELS = ("fa1", "triton")
SOURCE = {
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


def _at(ys: tuple, length: float) -> float:
    """log2-interpolated in the figure's lengths, clamped to 512 ... 16k (as ring.speed reads its curves)."""
    x = min(max(math.log2(max(length, 1)), 9.0), 14.0) - 9.0
    i = min(int(x), 4)
    return ys[i] + (ys[i + 1] - ys[i]) * (x - i)


def over_fa2(kernel: str, arch: str, length: float, head_dim: int = 128) -> float:
    """The kernel's forward + backward speed over FlashAttention-2's at ``length`` on ``arch`` (hopper/ampere)."""
    hd = 64 if head_dim <= 64 else 128
    f = FIG[(arch, hd)]
    r = _at(f["fa1"], length) / _at(f["fa2"], length)
    if kernel == "triton":
        a = FIG[("ampere", hd)]
        r *= _at(a["triton"], length) / _at(a["fa1"], length)
    return r


def arithmetic(kernel: str, arch: str, length: float, head_dim: int = 128) -> str:
    """The explain[] arithmetic of ``over_fa2``: the bars it reads and their product."""
    hd = 64 if head_dim <= 64 else 128
    f = FIG[(arch, hd)]
    gpu = {"hopper": "H100", "ampere": "A100"}[arch]
    txt = (f"{gpu} FlashAttention {_at(f['fa1'], length):.4g} / FlashAttention-2 {_at(f['fa2'], length):.4g} "
           f"TFLOP/s at {length:.0f} tokens, causal, head dim {hd}")
    if kernel == "triton":
        a = FIG[("ampere", hd)]
        txt += f" x A100 Triton {_at(a['triton'], length):.4g} / FlashAttention {_at(a['fa1'], length):.4g}"
    return txt + f" = {over_fa2(kernel, arch, length, head_dim):.3g} of FlashAttention-2's speed"
