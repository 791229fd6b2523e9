"""Per-architecture compute efficiency: the linear layers' share of peak, and attention's speed relative to it.

The planner times a transformer's linear layers at ``peak x linear x shape x roofline`` (gemm.py: tile and
wave quantization at small hidden sizes / tp splits, measured; memory-bound GEMMs at short sequences or
micro-batch 1) and its attention (QK^T, AV; the 4*s*h FLOPs per token and layer) at
``peak x linear x attention`` (fused kernels) or ``x unfused`` (the s x s scores in memory). With FP8 the
linear layers run at the FP8 peak x linear x FP8_OVER_BF16, their FP8 casts are timed at the memory
bandwidth, attention stays BF16. Each figure says where it comes from; where none is published for an
architecture, the figure says so and the default (or 1.0) stands in. ``--efficiency`` replaces all of it
(one rate for every FLOP, the roofline kept); a calibration from ``tandem bench train`` replaces the whole
compute model with the model's own measured rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.plan import gemm as G

# A large GEMM's share of peak (cuBLAS-class kernels): the reference attention kernels are compared with.
# The FlashAttention-2 paper (Dao 2023, arXiv 2307.08691, section 1) puts optimized GEMMs at up to 80-90% of
# an A100's peak; 0.8 as cost.GEMM_FRACTION takes a calibration's achieved GEMM rate to be.
GEMM_SHARE = 0.8
# FP8 GEMMs reach a lower share of their (2x) peak than BF16 GEMMs of theirs: 1523 of 1979 TFLOP/s at the
# largest K (tile-ai/tilelang benchmark/matmul_fp8, H800 SXM, M = N = 8192, K 16384) against BF16's 808 of
# 989 (OpenXLA's sm_90 table, N = K = 4096): (1523/1979) / (808/989) = 0.942.
FP8_OVER_BF16 = (1523 / 1979) / (808 / 989)
FP8_SOURCE = ("FP8 GEMMs keep (1523/1979)/(808/989) = 0.942 of BF16's share of peak (tilelang FP8 and OpenXLA "
              "BF16 GEMM measurements, H800/H100)")


@dataclass(frozen=True)
class ArchEfficiency:
    arch: str
    linear: float | None      # linear layers' sustained share of peak at large shapes (None: the default)
    linear_source: str
    attention: float          # fused attention kernels' rate over the linear layers' (1.0: as fast)
    attention_source: str
    unfused: float = 1.0      # attention without a fused kernel (s x s scores in memory) over the linear layers'


_FA2 = ("FlashAttention-2 reaches 50-73% of A100 peak (Dao 2023, arXiv 2307.08691) against ~80% for a large "
        "GEMM: 0.615 / 0.8")
_NO_LINEAR = "no architecture-specific figure: the default (Narayanan et al. 2021, 44-52% of A100 peak)"
# FlashAttention-2 paper, Table 3 (8 x A100 80GB, end to end, sequence 2048): GPT-3 1.3B at 196 TFLOP/s and 2.7B
# at 205 with FlashAttention-2, 142 and 149 without. Attention is s/6h / (1 + s/6h + V/12hL) of the FLOPs (0.133,
# 0.113); per unit of FLOPs (time x peak / FLOPs) the step takes 1/0.628 and 1/0.657, attention at
# FlashAttention-2's 0.615 of peak 0.133/0.615 and 0.113/0.615, and the memory-bound norms, adds, GeLU and loss
# of the repository's fused training stack (memory_bound.py, "fused": 4.43 and 7.18 MB a token at 0.9 x 2039
# GB/s) 0.083 and 0.068: the linear layers take 1.293 and 1.271, i.e. 0.671 and 0.698 of peak at those shapes,
# / their gemm.shape_factor (0.958, 0.972) = 0.700 and 0.719 at large shapes: 0.71, their mean (0.67 before the
# memory-bound time was charged apart). Without FlashAttention attention takes 1/0.455 - 1.293 - 0.083 = 0.822
# and 1/0.478 - 1.271 - 0.068 = 0.755: 0.162 and 0.149 of peak, 0.242 and 0.213 of the linear layers' rate at
# those shapes: 0.23. The runs' optimizer step is left in (their batch is not given): it would raise 0.71.
_A100_LINEAR = ("FlashAttention-2 paper Table 3: GPT-3 1.3B / 2.7B end to end on 8 A100s at 196 / 205 TFLOP/s; "
                "less attention at FlashAttention-2's rate and the memory-bound norms, adds, GeLU and loss, the "
                "linear layers run at 0.700 / 0.719 of peak at large shapes: 0.71")
_UNFUSED = 0.23
_UNFUSED_SRC = ("FlashAttention-2 paper Table 3: the same models at 142 / 149 TFLOP/s without FlashAttention put "
                "unfused attention (s x s scores in memory) at 0.242 / 0.213 of the linear layers' rate: 0.23")
# H100: the sources publish end-to-end MFU, which holds the memory-bound time memory_bound.py now charges apart.
# At GPT-3 175B's shape (Megatron-LM's strong-scaling model: sequence 4096, vocabulary 131072, fused kernels,
# BF16) that time is 1.45% of compute and the optimizer step 0.13% of the step: 0.50 / (1 - 0.0158) = 0.508.
_H100_LINEAR = ("Databricks, 'Turbocharged Training: Optimizing the Databricks Mosaic AI Stack With FP8' (2024): "
                "over 50% MFU in BF16 on 64 H100s; Megatron-LM's README: 47-48% end to end for its largest models "
                "on 6144 H100s (41% at 2B): 0.50 end to end, / (1 - 0.0158) for the memory-bound ops and optimizer "
                "step at GPT-3 175B's shape = 0.508")
ARCHS: dict[str, ArchEfficiency] = {a.arch: a for a in [
    ArchEfficiency("pascal", None, _NO_LINEAR, 1.0,
                   "no fused attention kernel (FlashAttention needs Ampere or later): batched GEMMs, as the linear "
                   "layers"),
    ArchEfficiency("volta", 0.30, "Megatron-LM's single-V100 baseline sustains 39 TFLOP/s, 30% of peak "
                   "(Shoeybi et al. 2019, sections 1 and 5.1)", 1.0,
                   "no fused attention kernel (FlashAttention needs Ampere or later): batched GEMMs, as the linear "
                   "layers"),
    ArchEfficiency("ampere", 0.71, _A100_LINEAR, 0.615 / GEMM_SHARE, _FA2, _UNFUSED),
    ArchEfficiency("ada", None, _NO_LINEAR, 0.615 / GEMM_SHARE,
                   "no published figure for Ada: FlashAttention-2's A100 share assumed (same kernels)", _UNFUSED),
    ArchEfficiency("hopper", 0.508, _H100_LINEAR, 0.75 / GEMM_SHARE,
                   "FlashAttention-3 (and cuDNN's fused attention, which Transformer Engine runs) reaches 740 "
                   "TFLOP/s, 75% of H100 BF16 peak (Shah et al. 2024, arXiv 2407.08608), against ~80% for a "
                   "large GEMM: 0.75 / 0.8 (FlashAttention-2 on H100 reaches 35%: --efficiency to model it)",
                   _UNFUSED),
    ArchEfficiency("blackwell", None, _NO_LINEAR, 1.0, "no published figure: as fast as the linear layers",
                   _UNFUSED),
    ArchEfficiency("cdna3", None, _NO_LINEAR, 1.0, "no published figure: as fast as the linear layers", _UNFUSED),
]}

GPU_ARCH = {"p100": "pascal", "v100-32gb": "volta", "a100-40gb": "ampere", "a100-80gb": "ampere",
            "a100-40gb-pcie": "ampere", "a100-80gb-pcie": "ampere", "l40s": "ada", "rtx4090": "ada", "l4": "ada",
            "h100-sxm": "hopper", "h100-sxm-500w": "hopper", "h100-pcie": "hopper", "h200": "hopper",
            "b200": "blackwell", "gb200": "blackwell", "mi300x": "cdna3"}


def arch_of(gpu_name: str) -> ArchEfficiency | None:
    """The table row for a preset GPU; None for a custom one (cluster file) or a CPU host."""
    a = GPU_ARCH.get(gpu_name)
    return ARCHS[a] if a else None


def linear(gpu_name: str, kind: str) -> float | None:
    """The linear layers' share of peak for a transformer (or a bare parameter count) on this GPU, or None for
    the planner's default."""
    a = arch_of(gpu_name)
    return a.linear if a is not None and kind in ("gpt", "params") else None


def attention(gpu_name: str, fused: bool = True) -> float:
    a = arch_of(gpu_name)
    return 1.0 if a is None else a.attention if fused else a.unfused


def attention_source(gpu_name: str, fused: bool = True) -> str:
    a = arch_of(gpu_name)
    return "" if a is None else a.attention_source if fused or a.unfused == 1.0 else _UNFUSED_SRC


def attention_rate(c, t, rate: float, eff: float) -> float:
    """FLOP/s of attention's QK^T and AV on cluster ``c`` for training ``t``: the bf16 rate under FP8
    (Transformer Engine runs only the linear layers in FP8), times the architecture's attention-kernel speed
    over the linear layers' (fused or not) unless --efficiency says the one rate for all."""
    if t.precision == "fp8":   # eff is the FP8 linear share: attention runs at BF16's
        base = c.flops_ref("bf16") * (eff if t.efficiency is not None else eff / FP8_OVER_BF16)
    else:
        base = rate
    return base if t.efficiency is not None else base * attention(c.gpu.name, t.flash_attention)


def transformer_compute(m, c, t, s, hw_fpg: float, rate: float, eff: float) -> dict:
    """Seconds of one step's compute per GPU for a transformer: linear layers at ``rate`` x their shape and
    roofline factors (+ FP8 casts at the memory bandwidth), attention apart (tandem.plan.cost.evaluate)."""
    from tandem.plan import memory_bound as MB
    from tandem.plan import moe_cp as MC

    g = m.gpt
    rc = {"none": 0, "selective": 3, "full": 1}[s.recompute]
    attn_fpg = (3 + rc) * g.seq * g.layers * g.attn_score_fwd_flops_per_token() * t.global_batch / s.world
    fp8 = t.precision == "fp8"
    shape = MC.cp_shape(g, s.cp) if s.cp > 1 else g
    roof = G.roofline(shape, s.tp, s.micro_batch, 1 if fp8 else t.bytes["act"], rate, c.gpu.memory_Bps)
    tiles = G.shape_factor(shape, s.tp, fp8) if t.efficiency is None else 1.0
    attn_s = attn_fpg / attention_rate(c, t, rate, eff)
    cast_s = 0.0
    if fp8 and t.efficiency is None and c.gpu.memory_Bps > 0:
        micro = t.global_batch // s.dp // s.micro_batch
        act, wt = G.fp8_cast_bytes(shape, s.tp, s.micro_batch * shape.seq)
        cast_s = (act * micro + wt) / s.pp / c.gpu.memory_Bps
    linear_s = (hw_fpg - attn_fpg) / (rate * roof * tiles)
    # norms, adds, activations, rotary, loss: memory-bound (--efficiency: the one measured rate holds them)
    mem_s = MB.step_seconds(m, c, t, s) if t.efficiency is None else 0.0
    return dict(compute=linear_s + attn_s + cast_s + mem_s, attn_s=attn_s, gemm=roof * tiles, roofline=roof,
                tiles=tiles, cast_s=cast_s, mem_s=mem_s)
