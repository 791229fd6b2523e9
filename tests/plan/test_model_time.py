"""Parameter counts, FLOPs, bubble and collectives against published numbers."""

import json

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, from_hf_config, gpt_stats, preset
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.collectives import Group, all_reduce, layout


def test_megatron_param_counts():
    # Narayanan et al. 2021, Table 1: 1T model (l=128, h=25600) has 1008B parameters; P = 12lh^2(1 + 13/12h + (V+s)/12lh)
    assert preset("gpt-1t").params / 1e9 == pytest.approx(1008, abs=1)
    assert preset("gpt3-175b").params / 1e9 == pytest.approx(174.6, abs=0.2)   # same formula, GPT-3 175B shape


def test_llama2_param_counts():
    # Touvron et al. 2023 / the HF checkpoints: 6,738,415,616 and 68,976,648,192 parameters
    assert preset("llama2-7b").params == 6_738_415_616
    assert preset("llama2-70b").params == 68_976_648_192


def test_hf_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
           "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert from_hf_config(p).params == 6_738_415_616


def test_megatron_flops_with_full_recompute():
    # Narayanan et al. 2021, eq. (3): F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration with full recompute
    m = preset("gpt-1t")
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200
    c = make_cluster("a100-80gb", 8, 384, nics_per_node=8)
    p = evaluate(m, c, Training(global_batch=B), Strategy(dp=6, tp=8, pp=64, micro_batch=1, recompute="full"))
    expected = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert p.hw_flops_per_gpu * 3072 == pytest.approx(expected, rel=1e-3)
    # ... and the paper's 84 days for 450B tokens at 163 TFLOP/s per GPU
    steps = 450e9 / (B * s)
    assert steps * p.hw_flops_per_gpu / 163e12 / 86400 == pytest.approx(84, rel=0.03)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 16), (8, 8), (8, 64)])
def test_bubble_fraction(p, m):
    # Huang et al. 2019 (GPipe) / Narayanan et al. 2021: bubble = (p-1)/(m+p-1) of the pipelined step, for
    # equal stages: GPT-3's shape with an 8-token vocabulary, so the last stage's logits cost nothing
    model = gpt_stats(GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=8))
    c = make_cluster("a100-80gb", 8, p)
    plan = evaluate(model, c, Training(global_batch=m), Strategy(dp=1, tp=8, pp=p, micro_batch=1))
    compute = plan.compute_s - plan.optimizer_s   # the optimizer step runs once, after the pipeline drains
    # a micro-batch's time on a stage includes its tp all-reduces, which the fill and drain repeat (pipeline.py)
    work = compute + sum(o.exposed_s for o in plan.comm if o.name == "tp-activations")
    assert plan.bubble_s / (work + plan.bubble_s) == pytest.approx((p - 1) / (m + p - 1), rel=1e-4)


def test_interleaving_divides_the_bubble_by_v():
    model = preset("gpt3-175b")
    c = make_cluster("a100-80gb", 8, 8)
    t = Training(global_batch=16)
    a = evaluate(model, c, t, Strategy(dp=1, tp=8, pp=8, micro_batch=1))
    b = evaluate(model, c, t, Strategy(dp=1, tp=8, pp=8, micro_batch=1, schedule="interleaved", virtual=4))
    assert b.bubble_s == pytest.approx(a.bubble_s / 4)


def test_ring_bus_factor_inside_a_node():
    # nccl-tests PERFORMANCE.md: all-reduce busbw = algbw x 2(n-1)/n, at NVLink 3's achievable 232 GB/s busbw
    c = make_cluster("a100-80gb", 8, 1)
    t = all_reduce(1e9, Group(8, 8, 1), c, calls=0)
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / 232e9)


def test_layout_tp_inside_dp_across():
    assert layout(8, 1, 8) == Group(8, 8, 1)        # tp 8 on one node
    assert layout(4, 8, 8) == Group(4, 1, 4)        # dp over 4 nodes, one member per node
    assert layout(16, 2, 8) == Group(16, 4, 4)      # dp 16 with tp 2: 4 per node, 4 nodes


def test_fp8_runs_only_the_linear_layers_at_the_fp8_rate():
    # Transformer Engine: FP8 GEMMs for Linear layers, attention in BF16. LLaMA-2 7B at 4096 tokens:
    # attention 4*s*h = 67.1 MFLOP/token/layer of 471.9 MFLOP; x 32 layers = 2.147 GFLOP of 15.36 GFLOP
    # per token with the logits (13.98%), at cuDNN's fused attention speed in BF16 (efficiency.py, the
    # FlashAttention-3 paper's causal figures at 4096 tokens), the linear layers at the FP8 rate.
    m = preset("llama2-7b")
    c = make_cluster("h100-sxm", 8, 1)
    s = Strategy(dp=8, micro_batch=1)
    fp8 = evaluate(m, c, Training(global_batch=8, precision="fp8", flash_attention=True), s)
    g = m.gpt
    attn = 3 * g.seq * g.layers * g.attn_score_fwd_flops_per_token()        # per sample (one a GPU)
    assert attn / m.flops_per_sample == pytest.approx(0.1398, abs=0.0001)
    # linear layers at the FP8 peak x H100's 0.508 x 0.942 (FP8 GEMMs' share over BF16's) x their shapes; attention
    # at cuDNN's causal 518 TFLOP/s forward and 499 x 518/609 backward on the half square it computes; the casts: 4 B per element of each linear layer's input
    # and output gradient (sum of K + N over a layer's four: 65,792; the logits' 36,096) for 4096 tokens, and of
    # the weights (K x N: 4096 x 49,408 a layer, 4096 x 32,000 the logits) once, at 3.35 TB/s
    assert fp8.efficiency == pytest.approx(0.508 * (1523 / 1979) / (808 / 989))
    cast = 4 * (4096 * (32 * 65_792 + 36_096) + 32 * 4096 * 49_408 + 4096 * 32_000) / 3350e9
    assert fp8.fp8_cast_s == pytest.approx(cast)
    linear = (fp8.hw_flops_per_gpu - attn) / (1978.9e12 * fp8.efficiency * fp8.linear_share)
    f = attn / 3 / 2                                 # one forward's half square
    assert fp8.compute_s == pytest.approx(linear + f / 518e12 + 2.5 * f / (499e12 * 518 / 609) + cast
                                          + fp8.mem_bound_s + fp8.optimizer_s)   # bandwidth_bound.py
    assert 0.9 < fp8.gemm_shape < 0.97             # FP8 loses more at K 4096 than BF16 (tilelang)
    bf16 = evaluate(m, c, Training(global_batch=8, precision="bf16", flash_attention=True), s)
    assert fp8.attn_bf16_s == pytest.approx(bf16.attn_s) and bf16.gemm_shape == 1.0 and bf16.fp8_cast_s == 0


def test_small_gemms_are_memory_bound():
    # Roofline (NVIDIA, Matrix Multiplication Background, "Math and Memory Bounds"): an A100-80GB at its linear
    # layers' 0.71 of 312 TFLOP/s over 2039 GB/s is compute-bound above 221.52e12 / 2039e9 = 108.6 FLOP/B. A tiny
    # GPT (h 512, ffn 2048, 64 tokens, vocab 1024, 2 layers) at micro-batch 1 is below it in every GEMM:
    # FLOPs 2 x (100.7 + 33.6 + 134.2 + 134.2) M + 67.1 M = 872.4 MFLOP; bytes (bf16)
    # 2 x (1,835,008 + 655,360 + 2 x 2,424,832) + 1,245,184 = 15,925,248 B -> 872.4e6 / (108.6 x 15.93e6) = 0.504
    m = gpt_stats(GPTShape(layers=2, hidden=512, heads=8, seq=64, vocab=1024))
    c = make_cluster("a100-80gb", 8, 1)
    p = evaluate(m, c, Training(global_batch=8, flash_attention=True), Strategy(dp=8, micro_batch=1))
    flops = 2 * (100_663_296 + 33_554_432 + 134_217_728 + 134_217_728) + 67_108_864
    rate = 0.71 * 312e12
    assert p.gemm_roofline == pytest.approx(flops / (rate / 2039e9 * 15_925_248))
    assert p.gemm_roofline == pytest.approx(0.504, abs=0.001)
    # tile and wave quantization on top (gemm.py: OpenXLA's measured H100 GEMM speeds at N, K of 512 to 2048)
    assert p.gemm_shape == pytest.approx(0.724, abs=0.001)
    attn = 3 * 64 * 2 * 4 * 64 * 512 * 8 / 8        # 4*s*h per token per layer, x3, 8 samples on 8 GPUs
    # per GEMM the slower of tiles and memory: all memory-bound here, so the roofline alone (gemm.linear_factor)
    assert p.linear_share == pytest.approx(p.gemm_roofline)
    # attention: FlashAttention-2 at 0.615 of A100 peak at 2048, x its curve's 309/362 forward and 214/291
    # backward at 64 tokens (clamped to the figure's 512)
    f = attn / 3
    assert p.compute_s == pytest.approx((p.hw_flops_per_gpu - attn) / (rate * p.linear_share)
                                        + f / (312e12 * 0.615 * 309 / 362) + 2 * f / (312e12 * 0.615 * 214 / 291)
                                        + p.mem_bound_s + p.optimizer_s)
    # GPT-3 175B's GEMMs at tp 8 are far above the ridge, and large: no change
    big = evaluate(preset("gpt3-175b"), make_cluster("a100-80gb", 8, 1), Training(global_batch=8),
                   Strategy(dp=1, tp=8, micro_batch=1))
    assert big.gemm_roofline == 1.0 and big.gemm_shape > 0.99


def test_selective_recompute_flops_as_korthikanti_count_them():
    # Korthikanti et al. 2022 (appendix, FLOPs): model FLOPs 72Bslh^2(1 + s/6h + V/12lh), hardware FLOPs with
    # selective recompute 72Bslh^2(1 + s/3h + V/12lh): 12*s*h per token per layer, 3x the attention core's
    # forward. For GPT-3 175B this ratio is 1.027, their HFU/MFU of 52.8% / 51.4%.
    m = gpt_stats(GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, bias=False))
    s, h, l, V = 2048, 12288, 96, 51200
    p = evaluate(m, make_cluster("a100-80gb", 8, 1), Training(global_batch=8),
                 Strategy(dp=1, tp=8, micro_batch=1, recompute="selective"))
    ratio = (1 + s / (3 * h) + V / (12 * l * h)) / (1 + s / (6 * h) + V / (12 * l * h))
    assert p.hw_flops_per_gpu / p.model_flops_per_gpu == pytest.approx(ratio, rel=1e-3)
    assert ratio == pytest.approx(52.8 / 51.4, abs=0.001)


def test_v100_transformer_efficiency_is_30_percent():
    # Shoeybi et al. 2019 (Megatron-LM), §1: one V100 sustains 39 TFLOP/s, 30% of its 125 TFLOP/s fp16 peak
    from tandem.plan.cost import default_efficiency
    t = Training(global_batch=8, precision="fp16")
    assert default_efficiency(preset("gpt3-175b"), make_cluster("v100-32gb", 8, 1), t) == 0.30
    assert default_efficiency(preset("gpt3-175b"), make_cluster("a100-80gb", 8, 1), t) == 0.71
    assert default_efficiency(preset("gpt3-175b"), make_cluster("p100", 8, 1), t) == 0.5   # no figure: default
