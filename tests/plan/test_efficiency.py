"""Per-architecture efficiency (tandem/plan/efficiency.py, gemm.py): every preset GPU has a row with its sources;
the A100 linear-layer share and the unfused-attention rate follow from the FlashAttention-2 paper's end-to-end
runs by the arithmetic in efficiency.py; measured GEMM speeds give the per-shape factor; FP8 keeps 0.942 of BF16's
share and pays for its casts; --efficiency overrides all of it."""

import pytest

from tandem.plan import efficiency as E
from tandem.plan import gemm as G
from tandem.plan import memory_bound as MB
from tandem.plan.config import Strategy, Training
from tandem.plan.cost import evaluate
from tandem.plan.explain import explain
from tandem.plan.hardware import GPUS, get_gpu, make_cluster
from tandem.plan.model import GPTShape, preset


def test_every_preset_gpu_has_an_architecture_with_sources():
    for name in GPUS:
        a = E.arch_of(name)
        assert a is not None, name
        assert a.linear_source and a.attention_source and 0 < a.attention <= 1.0 and 0 < a.unfused <= 1.0
    assert E.ARCHS["ampere"].attention == pytest.approx(0.615 / 0.8)
    assert E.ARCHS["hopper"].attention == pytest.approx(0.75 / 0.8)
    assert E.linear("v100-32gb", "gpt") == 0.30 and E.linear("a100-80gb", "gpt") == 0.71
    assert E.linear("h100-sxm", "gpt") == 0.508 and E.linear("b200", "gpt") is None
    assert E.attention("custom-gpu") == 1.0


def test_a100_figures_follow_from_flashattention2_table3():
    # GPT-3 1.3B (h 2048, 24 layers) and 2.7B (h 2560, 32 layers), sequence 2048, vocabulary 50257, 8 A100 80GB:
    # 196 / 205 TFLOP/s with FlashAttention-2, 142 / 149 without (Dao 2023, Table 3); the memory-bound ops of the
    # fused training stack are taken out before the linear layers' share is read off (memory_bound.py)
    lin, unf, mems = [], [], []
    for h, L, fa2, base in ((2048, 24, 196, 142), (2560, 32, 205, 149)):
        s, V = 2048, 50257
        g = GPTShape(layers=L, hidden=h, heads=16, seq=s, vocab=V)
        attn = (s / (6 * h)) / (1 + s / (6 * h) + V / (12 * h * L))
        per_layer, per_model = MB.layer_bytes(g, "fused", 2)
        flops = 3 * (L * g.layer_fwd_flops_per_token() + g.logits_fwd_flops_per_token())
        mem = (L * per_layer + per_model) / (MB.BANDWIDTH_SHARE * 2039e9) * 312e12 / flops
        linear_time = 312 / fa2 - attn / 0.615 - mem
        at_shape = (1 - attn) / linear_time
        lin.append(at_shape / G.shape_factor(g, 1))
        unf.append(attn / (312 / base - linear_time - mem) / at_shape)
        mems.append(mem)
    assert mems == pytest.approx([0.083, 0.068], abs=0.001)
    assert lin == pytest.approx([0.700, 0.719], abs=0.001) and unf == pytest.approx([0.242, 0.213], abs=0.001)
    assert E.ARCHS["ampere"].linear == pytest.approx(sum(lin) / 2, abs=0.002)
    assert E.ARCHS["ampere"].unfused == pytest.approx(sum(unf) / 2, abs=0.003)


def test_gemm_shapes_lose_speed_at_small_n_and_k_and_fp8_more():
    # OpenXLA's H100 table: N = K = 1024 runs at 598 of 808 TFLOP/s; tilelang FP8: K 1024 at 927 of 1523
    assert G.bf16_share(1024, 1024) == pytest.approx(598 / 808)
    assert G.fp8_gain(16384) == pytest.approx(1.0) and G.fp8_gain(1024) == pytest.approx(927 / 1523 / (693 / 808))
    shapes = [GPTShape(layers=24, hidden=h, heads=16, seq=2048, vocab=50368) for h in (768, 1536, 4096, 12288)]
    bf16 = [G.shape_factor(g, 1) for g in shapes]
    fp8 = [G.shape_factor(g, 1, fp8=True) for g in shapes]
    assert bf16 == sorted(bf16) and fp8 == sorted(fp8) and bf16[-1] > 0.99 and bf16[0] < 0.9
    assert all(f < b for f, b in zip(fp8, bf16))
    # a tp split narrows the GEMMs
    assert G.shape_factor(shapes[2], 8) < G.shape_factor(shapes[2], 1)
    assert E.FP8_OVER_BF16 == pytest.approx(0.942, abs=0.001)


def _plan(gpu, **train):
    m = preset("llama2-7b")
    return evaluate(m, make_cluster(gpu, 8, 1), Training(global_batch=8, **train), Strategy(dp=8, micro_batch=1))


def test_attention_runs_at_its_kernel_share_and_efficiency_overrides_it():
    a100, same = _plan("a100-80gb", flash_attention=True), _plan("a100-80gb", flash_attention=True, efficiency=0.71)
    assert a100.attn_ratio == pytest.approx(0.76875) and same.attn_ratio == 1.0
    # only the attention seconds grow, by 1 / 0.769
    assert a100.attn_s == pytest.approx(same.attn_s / 0.76875)
    # (--efficiency: one rate holds everything, the memory-bound ops and optimizer step too)
    assert same.mem_bound_s == same.optimizer_s == 0 < a100.mem_bound_s
    assert a100.compute_s - same.compute_s == pytest.approx(a100.attn_s - same.attn_s + a100.mem_bound_s
                                                            + a100.optimizer_s)
    text = " ".join(explain(a100))
    assert "at 0.769 of that rate (FlashAttention-2 reaches 50-73% of A100 peak" in text
    eager = _plan("a100-80gb")
    assert eager.attn_ratio == 0.23 and eager.attn_s == pytest.approx(a100.attn_s * 0.76875 / 0.23)
    assert "unfused attention (s x s scores in memory) at 0.242 / 0.213" in " ".join(explain(eager))
    v100 = _plan("v100-32gb", precision="fp16")
    assert v100.attn_ratio == 1.0 and v100.efficiency == 0.30


def test_fp8_pays_for_its_casts_and_efficiency_overrides_them():
    fp8, given = _plan("h100-sxm", precision="fp8", flash_attention=True), \
        _plan("h100-sxm", precision="fp8", flash_attention=True, efficiency=0.5)
    assert fp8.fp8_cast_s > 0 and given.fp8_cast_s == 0 and given.gemm_shape == 1.0
    assert "+ FP8 casts" in " ".join(explain(fp8))
    bf16 = _plan("h100-sxm", flash_attention=True)
    # FP8 speeds LLaMA-2 7B up by less than 2x: 0.942 x the share, smaller-K penalty, casts, BF16 attention
    assert 1.3 < bf16.compute_s / fp8.compute_s < 1.6


def test_h100_500w_preset_is_torchtitans_grand_teton():
    g = get_gpu("h100-sxm-500w")
    assert g.peak("bf16") == pytest.approx((989.4e12 + 835.5e12) / 2)      # between SXM and NVL: the midpoint
    assert g.peak("fp8") == pytest.approx((1978.9e12 + 1670.5e12) / 2)
    assert g.memory_Bps == 2400e9 and "500 W" in g.source
    assert E.arch_of("h100-sxm-500w").arch == "hopper"
    assert _plan("h100-sxm-500w").compute_s > _plan("h100-sxm").compute_s
