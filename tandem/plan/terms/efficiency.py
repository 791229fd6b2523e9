"""Per-architecture compute efficiency: the linear layers' share of peak, and the attention kernels' own.

The planner times a transformer's linear layers at ``peak x linear`` x their GEMMs' shape and roofline factor
(gemm.linear_factor: per GEMM, max(FLOPs / (R x tile share), bytes / BW): tile and wave quantization of
compute-bound GEMMs, measured; memory-bound GEMMs at short sequences or micro-batch 1) and its attention (QK^T,
AV; the 4*s*h FLOPs per token and layer) at the attention kernel's own share of peak, forward and backward apart,
by sequence length (``attention_times``): FlashAttention-2, FlashAttention-3 and cuDNN on Hopper from the
FlashAttention-3 paper's figures; FlashAttention-2 on Ampere from the FlashAttention-2 paper; unfused attention
(the s x s scores in memory) likewise. With FP8 the linear layers run at the FP8 peak x linear x FP8_OVER_BF16,
their FP8 casts are timed at the memory bandwidth, attention stays BF16. Each figure says where it comes from;
where none is published for an architecture, the figure says so and the default (or 1.0) stands in; nothing is
fitted. ``--efficiency`` replaces it (one rate for every FLOP, the roofline kept; FP8's attention at the BF16
peak x that share); a calibration from ``tandem bench train`` replaces the whole compute model with the
model's own measured rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tandem.plan.inputs.hardware import GPU_ARCH
from tandem.plan.terms.attention_kernels import (BWD_FLOPS, FIRST_GEN, FIRST_GEN_SOURCE, causal_speed, over_fa2,
                                                 speed, train_speed)
from tandem.plan.terms.bandwidth_bound import step_seconds
from tandem.plan.terms.context import KERNEL as CP_KERNEL
from tandem.plan.terms.context import block_length, cp_shape, diagonal_fraction
from tandem.plan.terms.gemm import fp8_cast_bytes, linear_factor

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
    attention: float          # no published kernel figure: fused attention's rate over the linear layers'
    attention_source: str
    unfused: float = 1.0      # ... and unfused attention's (s x s scores in memory)
    fused: str = ""           # the kernel the architecture's frameworks usually run (--flash-attention)
    tensor_cores: bool = True  # gemm.py's measured tile/wave factor applies (BF16/FP16/FP8 tensor-core GEMMs)


_NO_LINEAR = "no architecture-specific figure: the default (Narayanan et al. 2021, 44-52% of A100 peak)"
# FlashAttention-2 paper, Table 3 (8 x A100 80GB, end to end, sequence 2048): GPT-3 1.3B at 196 TFLOP/s and 2.7B
# at 205 with FlashAttention-2, 142 and 149 without. Attention is s/6h / (1 + s/6h + V/12hL) of the FLOPs (0.133,
# 0.113); per unit of FLOPs (time x peak / FLOPs) the step takes 1/0.628 and 1/0.657, attention at
# FlashAttention-2's 0.615 of peak 0.133/0.615 and 0.113/0.615, and the memory-bound norms, adds, GeLU and loss
# of the repository's fused training stack (bandwidth_bound.py, "fused": 4.43 and 7.18 MB a token at 0.9 x 2039
# GB/s) 0.083 and 0.068: the linear layers take 1.293 and 1.271, i.e. 0.671 and 0.698 of peak at those shapes,
# / their gemm.shape_factor (0.958, 0.972) = 0.700 and 0.719 at large shapes: 0.71, their mean (0.67 before the
# memory-bound time was charged apart). Without FlashAttention attention takes 1/0.455 - 1.293 - 0.083 = 0.822
# and 1/0.478 - 1.271 - 0.068 = 0.755: 0.162 and 0.149 of peak, 0.242 and 0.213 of the linear layers' rate at
# those shapes: 0.23 (the other architectures' unfused factor, relative to their linear rate). A100_UNFUSED is
# the measured absolute share itself, (0.162 + 0.149) / 2 = 0.156 of peak (0.23 was a ratio at those models' own
# shapes, 0.671 / 0.698, not at the 0.71 large-shape share). The runs' optimizer step is left in (their batch is
# not given): it would raise 0.71.
_A100_LINEAR = ("FlashAttention-2 paper Table 3: GPT-3 1.3B / 2.7B end to end on 8 A100s at 196 / 205 TFLOP/s; "
                "less attention at FlashAttention-2's rate and the memory-bound norms, adds, GeLU and loss, the "
                "linear layers run at 0.700 / 0.719 of peak at large shapes: 0.71")
_UNFUSED = 0.23
# The H100 figure is an end-to-end MFU (attention, communication and everything else included) taken as the
# linear layers' share: a linear-layer share is at least the MFU of the run it is in, so of the two published
# figures the higher (Databricks' 50%) is the one that is a lower bound on it rather than a mix of terms; the
# lower (Megatron-LM's 47%) would put NeMo's FP8 table (tests/plan/test_published_nemo_fp8.py) at 13.5% median.
_H100_LINEAR = ("Databricks, 'Turbocharged Training: Optimizing the Databricks Mosaic AI Stack With FP8' (2024): "
                "over 50% MFU in BF16 on 64 H100s, an end-to-end MFU taken as the linear layers' share (at least "
                "the MFU: it leaves out attention and communication, so the higher of the two published figures; "
                "Megatron-LM's README: 47-48% end to end for its largest models on 6144 H100s, 41% at 2B; 0.47 would "
                "put NeMo's FP8 table at 13.5% median error); / (1 - 0.0158) for the memory-bound ops and optimizer "
                "step bandwidth_bound.py charges apart, at GPT-3 175B's shape = 0.508")
# The sources' MFU holds the memory-bound time bandwidth_bound.py now charges apart: at GPT-3 175B's shape
# (Megatron-LM's strong-scaling model: sequence 4096, vocabulary 131072, fused kernels, BF16) that time is 1.45%
# of compute and the optimizer step 0.13% of the step: 0.50 / (1 - 0.0158) = 0.508.
_NO_KERNEL = ("no fused attention kernel (FlashAttention needs Ampere or later): batched GEMMs, as the linear "
              "layers")
ARCHS: dict[str, ArchEfficiency] = {a.arch: a for a in [
    ArchEfficiency("pascal", None, _NO_LINEAR, 1.0, _NO_KERNEL, tensor_cores=False),
    ArchEfficiency("volta", 0.30, "Megatron-LM's single-V100 baseline sustains 39 TFLOP/s, 30% of peak "
                   "(Shoeybi et al. 2019, sections 1 and 5.1)", 1.0, _NO_KERNEL),
    ArchEfficiency("ampere", 0.71, _A100_LINEAR, 1.0, "", _UNFUSED, fused="fa2"),
    ArchEfficiency("ada", None, _NO_LINEAR, 1.0, "", _UNFUSED, fused="fa2"),
    ArchEfficiency("hopper", 0.508, _H100_LINEAR, 1.0, "", _UNFUSED, fused="cudnn"),
    ArchEfficiency("blackwell", None, _NO_LINEAR, 1.0, "no published figure: as fast as the linear layers",
                   _UNFUSED),
    ArchEfficiency("cdna3", None, _NO_LINEAR, 1.0, "no published figure: as fast as the linear layers", _UNFUSED),
]}

H100_PEAK = 989.4   # TFLOP/s, dense BF16, H100 SXM5: the FlashAttention-3 paper's GPU
# FlashAttention-2 on A100 (Dao 2023, arXiv 2307.08691): "50-73% of the theoretical maximum FLOPs/s" (abstract);
# its midpoint, 0.615, at sequence 2048 (Table 3's), forward and backward alike; other lengths follow the same
# kernel's curve on H100 (attention_kernels.FWD_HD128 / BWD_HD128["fa2"], relative to 2048). Unfused attention on A100: Table
# 3's runs without FlashAttention (derivation above), at 2048, flat (no A100 figure by length).
A100_FA2, A100_REF_LEN, A100_UNFUSED = 0.615, 2048, (0.162 + 0.149) / 2
KERNEL_SOURCE = {
    ("hopper", "fa3"): "FlashAttention-3 on H100 (Shah et al. 2024, arXiv 2407.08608, head dim 128 figures)",
    ("hopper", "cudnn"): "cuDNN fused attention on H100 (Transformer Engine's; FlashAttention-3 paper's figures)",
    ("hopper", "fa2"): "FlashAttention-2 on H100: ~35% of peak (FlashAttention-3 paper's figures)",
    ("hopper", "unfused"): "unfused attention on H100: the FlashAttention-3 paper's 'Standard attention' figures",
    ("ampere", "fa2"): "FlashAttention-2 on A100: 50-73% of peak, 0.615 at 2k (Dao 2023), by length as on H100",
    ("ampere", "unfused"): ("unfused attention (s x s scores in memory) at 0.156 of A100 peak: FlashAttention-2 "
                            "paper Table 3's runs without it (142 / 149 TFLOP/s, 0.162 / 0.149 of peak, their mean)"),
}
for _k in FIRST_GEN:   # first-generation FlashAttention: a share of FlashAttention-2's (attention_kernels.py)
    KERNEL_SOURCE[("hopper", _k)] = KERNEL_SOURCE[("ampere", _k)] = FIRST_GEN_SOURCE[_k]
    KERNEL_SOURCE[("ada", _k)] = "no published figure for Ada: Ampere's " + FIRST_GEN_SOURCE[_k]
KERNEL_SOURCE[("ada", "fa2")] = "no published figure for Ada: " + KERNEL_SOURCE[("ampere", "fa2")]
KERNEL_SOURCE[("ada", "unfused")] = "no published figure for Ada: " + KERNEL_SOURCE[("ampere", "unfused")]


def arch_of(gpu_name: str) -> ArchEfficiency | None:
    """The table row for a preset GPU; None for a custom one (cluster file) or a CPU host."""
    a = GPU_ARCH.get(gpu_name)
    return ARCHS[a] if a else None


def linear(gpu_name: str, kind: str) -> float | None:
    """The linear layers' share of peak for a transformer on this GPU, or None for the planner's default (a
    bare --params model or a CNN: the default, which is an end-to-end figure)."""
    a = arch_of(gpu_name)
    return a.linear if a is not None and kind == "gpt" else None


def kernel(gpu_name: str, t, cp: int = 1) -> str:
    """The attention kernel a plan runs: --attention-kernel, "fused" the architecture's usual one; ring attention
    (cp > 1) is built on fused kernels, and torch's context_parallel runs SDPA's flash backend (FlashAttention-2)."""
    k = t.attention_kernel
    if cp > 1 and k == "unfused":
        k = "fused"
    a = arch_of(gpu_name)
    if k == "fused":
        k = a.fused if a is not None and a.fused else "fused"
    if cp > 1 and t.cp_impl == "torch" and k in ("cudnn", "fa3"):
        k = "fa2"
    return k


def curve_of(a: ArchEfficiency | None, k: str) -> str | None:
    """Which published curve an (architecture, kernel) reads: hopper its own, ampere/ada FlashAttention-2's."""
    if a is None or (a.arch, k) not in KERNEL_SOURCE:
        return None
    return a.arch if a.arch == "hopper" else "ampere"


def has_curve(gpu_name: str, k: str) -> bool:
    return curve_of(arch_of(gpu_name), k) is not None and k != "unfused"


@lru_cache(maxsize=4096)   # pure in its arguments (published tables): once per candidate before
def kernel_shares(gpu_name: str, k: str, length: float, ring: bool = False,
                  head_dim: int = 128) -> tuple[float, float] | None:
    """(forward, backward) share of the BF16 peak in the planner's FLOP count (backward 2 x forward), or None
    where no figure is published (attention then runs at the linear layers' rate x the row's factor).
    FlashAttention-1 and its Triton kernel: FlashAttention-2's shares x their speed over it (attention_kernels.over_fa2)."""
    fig = curve_of(arch_of(gpu_name), k)
    if fig is not None and k in FIRST_GEN:
        fa2 = kernel_shares(gpu_name, "fa2", length, ring)
        r = over_fa2(k, fig, length, head_dim)
        return fa2[0] * r, fa2[1] * r
    if fig == "hopper" and k == "unfused":   # the s x s square computed whole, then masked
        return speed(k, length) / H100_PEAK, speed(k, length, True) * 2 / BWD_FLOPS / H100_PEAK
    if fig == "hopper":
        # papers count backward as 2.5 F: in the planner's 2 F it runs at 2 / 2.5 of its TFLOP/s. A causal kernel
        # computes half the square the planner counts (x 2 in its count): at the causal figure's speed on one
        # sequence; under cp the ring's blocks are mostly unmasked halves: the non-causal speed
        sp = (lambda bwd: speed(k, length, bwd)) if ring else (lambda bwd: causal_speed(k, length, bwd))
        return 2 * sp(False) / H100_PEAK, 2 * sp(True) * 2 / BWD_FLOPS / H100_PEAK
    if fig == "ampere" and k == "fa2":
        return (A100_FA2 * speed("fa2", length) / speed("fa2", A100_REF_LEN),
                A100_FA2 * speed("fa2", length, True) / speed("fa2", A100_REF_LEN, True))
    if fig == "ampere":
        return A100_UNFUSED, A100_UNFUSED
    return None


def attention_times(c, t, s, flops_fwd: float, rc: int, rate: float, eff: float, length: float,
                    diagonal: float = 0.0, head_dim: int = 128) -> tuple[float, str]:
    """(seconds, kernel) of attention's QK^T and AV: ``flops_fwd`` one forward's FLOPs per GPU, run 1 + rc times
    forward and once backward (2 x), at the kernel's published share of the BF16 peak by length; with --efficiency
    or no figure, at the linear layers' (BF16) rate x the row's factor. Under a ring (cp > 1, ``diagonal`` the
    local chunk's s/cp tokens): 1/cp of the FLOPs are the diagonal step's causal block, at the causal speed at
    s/cp (context.diagonal_fraction), the rest the ring's unmasked blocks at ``length``."""
    k = kernel(c.gpu.name, t, s.cp)
    shares = kernel_shares(c.gpu.name, k, length, s.cp > 1, head_dim) if t.efficiency is None else None
    prec = "bf16" if t.precision == "fp8" else t.precision
    if shares is not None and prec in ("bf16", "fp16"):   # a calibrated rate is a GEMM's at GEMM_SHARE of peak
        peak = c.flops_ref(prec) / (GEMM_SHARE if prec in c.achieved_flops else 1.0)
        d = diagonal_fraction(s.cp, t.cp_impl) if diagonal and s.cp > 1 else 0.0
        diag = kernel_shares(c.gpu.name, k, diagonal, False, head_dim) if d else None
        parts = [(1 - d, shares)] + ([(d, diag)] if diag is not None else [])
        return sum(w * ((1 + rc) * flops_fwd / (peak * sh[0]) + 2 * flops_fwd / (peak * sh[1]))
                   for w, sh in parts), k
    if t.precision == "fp8":   # eff is the FP8 linear share (or --efficiency): attention runs at BF16's
        base = c.flops_ref("bf16") * (eff if t.efficiency is not None else eff / FP8_OVER_BF16)
    else:
        base = rate
    a = arch_of(c.gpu.name)
    if t.efficiency is None and a is not None:
        base *= a.unfused if k == "unfused" else a.attention
    return (3 + rc) * flops_fwd / base, k


def attention_rate(c, t, s, seq: int, rate: float, eff: float) -> float:
    """FLOP/s (planner's count) of attention on the ring's blocks under cp (context.cp_comm's hiding window)."""
    secs, _ = attention_times(c, t, s, 1.0, 0, rate, eff, block_length(seq, s.cp) if s.cp > 1 else seq)
    return 3.0 / secs


def transformer_compute(m, c, t, s, hw_fpg: float, rate: float, eff: float, memo: dict | None = None) -> dict:
    """Seconds of one step's compute per GPU for a transformer: linear layers at ``rate`` x their GEMMs' shape
    and roofline factor (+ FP8 casts at the memory bandwidth), attention at its kernel's rate (cost.evaluate).
    ``memo``: the search's, for one (m, c, t): the result depends on the strategy only through the degrees,
    the micro-batch and the recompute (hw_fpg, rate and eff follow from them), not on ZeRO, hsdp or the
    schedule, which the search varies most; the caller must not change the dict."""
    key = (s.tp, s.cp, s.pp, s.dp, s.ep, s.micro_batch, s.recompute)
    if memo is not None and key in memo:
        return memo[key]
    out = _transformer_compute(m, c, t, s, hw_fpg, rate, eff)
    if memo is not None:
        memo[key] = out
    return out


def _transformer_compute(m, c, t, s, hw_fpg: float, rate: float, eff: float) -> dict:
    g = m.gpt
    rc = {"none": 0, "selective": 3, "full": 1}[s.recompute]
    attn_fwd = g.seq * g.layers * g.attn_score_fwd_flops_per_token() * t.global_batch / s.world
    attn_fpg = (3 + rc) * attn_fwd
    fp8 = t.precision == "fp8"
    shape = cp_shape(g, s.cp) if s.cp > 1 else g
    a = arch_of(c.gpu.name)
    # measured tile/wave factor: tensor-core GEMMs only (not a CPU calibration, a custom GPU, fp32/tf32)
    tensor = t.efficiency is None and a is not None and a.tensor_cores and t.precision in ("bf16", "fp16", "fp8")
    elt = 1 if fp8 else t.bytes["act"]
    lin, roof, tiles = linear_factor(shape, s.tp, s.micro_batch, elt, rate, c.gpu.memory_Bps, fp8, tensor)
    attn_s, k = attention_times(c, t, s, attn_fwd, rc, rate, eff,
                                block_length(g.seq, s.cp) if s.cp > 1 else g.seq, g.seq / s.cp, g.hidden // g.heads)
    cast_s = 0.0
    if fp8 and t.efficiency is None and c.gpu.memory_Bps > 0:
        micro = t.global_batch // s.dp // s.micro_batch
        act, wt = fp8_cast_bytes(shape, s.tp, s.micro_batch * shape.seq, getattr(m, "moe", None), s.ep)
        cast_s = (act * micro + wt) / s.pp / c.gpu.memory_Bps
    linear_s = (hw_fpg - attn_fpg) / (rate * lin)
    # norms, adds, activations, rotary, loss: memory-bound (--efficiency: the one measured rate holds them)
    mem_s = step_seconds(m, c, t, s) if t.efficiency is None else 0.0
    return dict(compute=linear_s + attn_s + cast_s + mem_s, attn_s=attn_s, gemm=lin, roofline=roof, tiles=tiles,
                cast_s=cast_s, mem_s=mem_s, kernel=k, attn_ratio=attn_fpg / attn_s / rate if attn_s and rate else 1.0)


def block_share(gpu: str, impl: str, seq: int, cp: int, kernel: str | None = None) -> float:
    """Speed of the ring's per-step attention kernel over the same kernel on the whole sequence (forward and
    backward together); 1.0 where the GPU has no such figure (efficiency.py's attention model decides)."""
    k = kernel or CP_KERNEL[impl]
    if cp <= 1 or not has_curve(gpu, k):
        return 1.0
    return train_speed(k, block_length(seq, cp)) / train_speed(k, seq)
