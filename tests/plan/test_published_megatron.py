"""Throughput against a published table: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM" (SC21), Table 1: GPT models from 1.7B to 1T parameters on 32 to 3072 A100s
(DGX A100 nodes, 8 x HDR InfiniBand each), sequence 2048, vocabulary 51200, mixed precision, activation
recomputation, achieved teraFLOP/s per GPU as the paper counts them (hardware FLOPs, recompute included).

The planner gets each row's shape, degrees and batch (micro-batch 1, 1F1B, full recompute, fp16, Adam) and
its default efficiency; nothing is fitted to the table. Issue 14's tolerance: 10% median, 25% max.
Measured with NVLink at its datasheet 300 GB/s and attention at the linear layers' rate: median 9.6%, max 22.1%.
With NVLink 3 at the achievable 232 GB/s busbw nccl-tests publishes (issue 14 point 6) alone: median 10.7%, max
22.8% (worse: the tensor-parallel all-reduces are exposed in full). With attention at FlashAttention-2's share
of A100 peak as well (efficiency.py; Megatron-LM in 2021 ran unfused attention, likely slower still): median
9.4%, max 23.1% (+9.8% 1.7B ... -23.1% 529.6B): the planner is low on the largest models (pipeline bubble and
exposed tensor-parallel traffic it counts in full, one linear-layer efficiency for every large GEMM).
With the per-architecture compute model (efficiency.py: A100 linear layers at 0.67 of peak and unfused attention
at 0.24 of their rate, both from the FlashAttention-2 paper's Table 3; gemm.py: measured GEMM speeds by shape):
median 3.9%, max 7.8% (+7% 1.7B ... -3% 529.6B).
As merged (memory-bound ops charged apart, A100 linear layers at 0.71, unfused attention at 0.23 x 0.71 = 0.163 of
peak): median 6.1%, max 11.0%. With unfused attention at its measured 0.156 of A100 peak (the mean of Table 3's
0.162 / 0.149): median 5.0%, max 10.5% (+4.6% 1.7B, +10.5% 76.1B, +0.7% 529.6B; every row fast). With the
pipeline's fill and drain repeating each micro-batch's tensor-parallel all-reduces and the tied embedding's gradient
all-reduced between the first and last stage (pipeline.py): median 4.5%, max 9.7% (+4.6% 1.7B, +9.7% 76.1B,
-0.1% 529.6B)."""

from statistics import median

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

# parameters (B), heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def _row(params_b, heads, hidden, layers, tp, pp, gpus, batch, tflops):
    m = gpt_stats(GPTShape(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200))
    c = make_cluster("a100-80gb", 8, gpus // 8, inter="ib-hdr", nics_per_node=8)
    p = evaluate(m, c, Training(global_batch=batch, precision="fp16", optimizer="adam", runtime="megatron-2021"),
                 Strategy(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=1, recompute="full"))
    return m, p.hw_flops_per_gpu / p.step_s / 1e12


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r[0]}B" for r in TABLE_1])
def test_parameter_counts_match_the_table(row):
    m, _ = _row(*row)
    assert m.params / 1e9 == pytest.approx(row[0], abs=0.05)   # the table rounds to 0.1B (1.65 -> 1.7)


def test_teraflops_per_gpu_within_the_issue_tolerance():
    errs = {r[0]: _row(*r)[1] / r[-1] - 1 for r in TABLE_1}
    assert median(abs(e) for e in errs.values()) <= 0.10, errs
    assert max(abs(e) for e in errs.values()) <= 0.25, errs
