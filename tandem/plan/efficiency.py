"""Per-architecture compute efficiency: the linear layers' share of peak, and attention's speed relative to it.

The planner times a transformer's linear layers at ``peak x linear x roofline(shape)`` (gemm.py: GEMMs of
small hidden sizes, short sequences or micro-batch 1 are memory-bound) and its attention (QK^T, AV; the
4*s*h FLOPs per token and layer) at ``peak x linear x attention``. Each figure says where it comes from;
where none is published for an architecture, the figure says so and the A100's (or 1.0) stands in.
``--efficiency`` replaces both (attention then runs at the linear layers' rate); a calibration from
``tandem bench train`` replaces the whole compute model with the model's own measured rate.
"""

from __future__ import annotations

from dataclasses import dataclass

# A large GEMM's share of peak (cuBLAS-class kernels): the reference attention kernels are compared with.
# The FlashAttention-2 paper (Dao 2023, arXiv 2307.08691, section 1) puts optimized GEMMs at up to 80-90% of
# an A100's peak; 0.8 as cost.GEMM_FRACTION takes a calibration's achieved GEMM rate to be.
GEMM_SHARE = 0.8


@dataclass(frozen=True)
class ArchEfficiency:
    arch: str
    linear: float | None      # linear layers' sustained share of peak at large shapes (None: the default)
    linear_source: str
    attention: float          # attention kernels' rate over the linear layers' (1.0: as fast)
    attention_source: str


_FA2 = ("FlashAttention-2 reaches 50-73% of A100 peak (Dao 2023, arXiv 2307.08691) against ~80% for a large "
        "GEMM: 0.615 / 0.8")
_NO_LINEAR = "no architecture-specific figure: the default (Narayanan et al. 2021, 44-52% of A100 peak)"
ARCHS: dict[str, ArchEfficiency] = {a.arch: a for a in [
    ArchEfficiency("pascal", None, _NO_LINEAR, 1.0,
                   "no fused attention kernel (FlashAttention needs Ampere or later): batched GEMMs, as the linear "
                   "layers"),
    ArchEfficiency("volta", 0.30, "Megatron-LM's single-V100 baseline sustains 39 TFLOP/s, 30% of peak "
                   "(Shoeybi et al. 2019, sections 1 and 5.1)", 1.0,
                   "no fused attention kernel (FlashAttention needs Ampere or later): batched GEMMs, as the linear "
                   "layers"),
    ArchEfficiency("ampere", None, _NO_LINEAR, 0.615 / GEMM_SHARE, _FA2),
    ArchEfficiency("ada", None, _NO_LINEAR, 0.615 / GEMM_SHARE,
                   "no published figure for Ada: FlashAttention-2's A100 share assumed (same kernels)"),
    ArchEfficiency("hopper", None, _NO_LINEAR, 0.75 / GEMM_SHARE,
                   "FlashAttention-3 (and cuDNN's fused attention, which Transformer Engine runs) reaches 740 "
                   "TFLOP/s, 75% of H100 BF16 peak (Shah et al. 2024, arXiv 2407.08608), against ~80% for a "
                   "large GEMM: 0.75 / 0.8 (FlashAttention-2 on H100 reaches 35%: --efficiency to model it)"),
    ArchEfficiency("blackwell", None, _NO_LINEAR, 1.0, "no published figure: as fast as the linear layers"),
    ArchEfficiency("cdna3", None, _NO_LINEAR, 1.0, "no published figure: as fast as the linear layers"),
]}

GPU_ARCH = {"p100": "pascal", "v100-32gb": "volta", "a100-40gb": "ampere", "a100-80gb": "ampere",
            "a100-40gb-pcie": "ampere", "a100-80gb-pcie": "ampere", "l40s": "ada", "rtx4090": "ada", "l4": "ada",
            "h100-sxm": "hopper", "h100-pcie": "hopper", "h200": "hopper", "b200": "blackwell",
            "gb200": "blackwell", "mi300x": "cdna3"}


def arch_of(gpu_name: str) -> ArchEfficiency | None:
    """The table row for a preset GPU; None for a custom one (cluster file) or a CPU host."""
    a = GPU_ARCH.get(gpu_name)
    return ARCHS[a] if a else None


def linear(gpu_name: str, kind: str) -> float | None:
    """The linear layers' share of peak for a transformer (or a bare parameter count) on this GPU, or None for
    the planner's default."""
    a = arch_of(gpu_name)
    return a.linear if a is not None and kind in ("gpt", "params") else None


def attention(gpu_name: str) -> float:
    a = arch_of(gpu_name)
    return a.attention if a is not None else 1.0


def attention_rate(c, t, rate: float, eff: float) -> float:
    """FLOP/s of attention's QK^T and AV on cluster ``c`` for training ``t``: the bf16 rate under FP8
    (Transformer Engine runs only the linear layers in FP8), times the architecture's attention-kernel speed
    over the linear layers' unless --efficiency says the one rate for all."""
    base = c.flops_ref("bf16") * eff if t.precision == "fp8" else rate
    return base if t.efficiency is not None else base * attention(c.gpu.name)
