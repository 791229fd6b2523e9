"""Throughput against a published table with FP8 and context-parallel rows: NVIDIA NeMo's performance summary,
NeMo 24.07 container, DGX-H100 (8 x H100 SXM, 8 x 400 Gb/s InfiniBand per node), FP8, "Pretraining" table
(NVIDIA/NeMo, docs/source/performance/performance_summary.md; the rows below with their Tokens / sec / GPU and
Model TFLOP / sec / GPU as printed). The two LLAMA3 rows run context parallelism, cp 2 at sequence 8192.

The planner gets each row's shape, GPUs, GBS, MBS, sequence and TP/PP/CP/VP (dp the rest, ZeRO-1 as NeMo's
distributed optimizer with its parameter gather overlapped), FP8 on the linear layers only, and its default
efficiency; nothing is fitted to this table. The table has no recompute column: these are taken with none
(an assumption), with fused attention (NeMo runs Transformer Engine's): every row then fits in 80 GiB, as it
must, having run; with Korthikanti et al.'s eager attention (the s x s scores stored) none would.
Issue 14's tolerance: 10% median, 25% max. Measured when written: median 6.0%, max 16.1% (+16.1% LLAMA3-8B cp 2,
-2.6% LLAMA3-70B cp 2); with links at their achievable nccl-tests rates and attention at FlashAttention-3's
share of H100 peak (efficiency.py): median 8.5%, max 13.4% (+13.4% LLAMA3-8B cp 2, -8.5% LLAMA2-70B); with the
per-architecture compute model (H100 linear layers at 0.50 of peak, FP8 at 0.942 of that share, GEMM shapes and FP8
casts timed: efficiency.py, gemm.py): median 8.9%, max 16.0% (-16.0% LLAMA2-70B, -14.5% GPT3-175B on 512). With torch's ring
terms (context.py) the cp rows' blocks run on cuDNN's fused attention. With the attention-kernel model (attention_kernel
"cudnn", Transformer Engine's fused attention; its causal speed from the FlashAttention-3 paper, half the counted
square): median 7.7%, max 22.5%, within the tolerance. The model FLOPs per token the table implies (TFLOP/s over
tokens/s) match the planner's count to 0.1% on every row.
As merged (memory-bound ops and the optimizer step charged apart, H100 linear share 0.508): median 8.4%, max 16.7%
(+16.7% LLAMA3-8B, -14.3% LLAMA2-70B, -13.7% GPT3-175B on 512), within the tolerance.
With the pipeline's fill and drain repeating each micro-batch's TP and ring communication and the tied embedding's
gradient all-reduce (pipeline.py): median 8.7%, max 14.9% (+14.9% LLAMA3-8B, -14.3% LLAMA2-70B, -13.9%
GPT3-175B on 512).
Tensor-parallel overlap (--tp-overlap, tandem/plan/terms/tensor_parallel.py) as the NeMo-Framework-Launcher's 24.07 training
configs set ub_tp_comm_overlap (TP_OVERLAP below): on (ring) for LLAMA2-70B (llama2_70b.yaml: TP 4, PP 4, VP 20 as
the row) and LLAMA3-70B (llama3_70b.yaml: TP 4, PP 4, CP 2; VP 10 where the row has 5); off for GPT3-175B
(gpt3/175b.yaml and 175b_fp8.yaml both False; neither has the rows' TP 4 / PP 8 / VP 6 exactly); the tp 1 rows
have nothing to overlap. LLAMA2-70B -14.3% -> -3.4%, LLAMA3-70B -6.7% -> +5.5%: median 5.5%, max 14.9%
(+14.9% LLAMA3-8B, -13.7% GPT3-175B on 512).
With Megatron-LM's even split as the interleaved schedule's default (stages.py: 80 layers = 4 stages x 5 chunks x 4,
where the balanced split put one layer fewer on the last stage): LLAMA3-70B +5.5% -> +5.3%, median 5.3%, max 14.9%.
The GPT-3 175B rows' configs turn userbuffers off, but Transformer Engine's layers (which they run: mcore_gpt,
transformer_engine True, sequence parallel) still launch the column-parallel dgrad reduce-scatter async beside the
wgrad GEMM (TE v1.7 layernorm_linear.py, "Overlap dgrad-RS/AR with wgrad"): --tp-overlap bulk (tensor_parallel.py).
GPT3-175B -8.7% -> -6.2% (128) and -13.9% -> -11.7% (512): median 5.3%, max 14.9% (+14.9% LLAMA3-8B).
The interleaved schedule's sends as the same 24.07 launcher files set them (session 9): overlap_p2p_comm True and
batch_p2p_comm False in gpt3/175b.yaml, 175b_fp8.yaml, llama/llama2_13b.yaml, llama2_70b.yaml and llama3_70b.yaml
(NeMo-Framework-Launcher tag 24.07, 8325688d), so --overlap-p2p (pipeline.py; no effect on the pp 1 rows):
GPT3-175B -6.2% -> -2.9% (128) and -11.7% -> -8.6% (512), LLAMA2-13B +1.0% -> +3.0%, LLAMA2-70B -3.4% -> +6.0%,
LLAMA3-70B +5.3% -> +7.7%: median 6.0%, max 14.9% (+14.9% LLAMA3-8B).
"""

from statistics import median

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

LLAMA = dict(gated=True, bias=False, norm="rmsnorm", tied=False, learned_pos=False)
SHAPES = {
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200),
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, ffn=11008, **LLAMA),
    "llama2-13b": dict(layers=40, hidden=5120, heads=40, seq=4096, vocab=32000, ffn=13824, **LLAMA),
    "llama2-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, seq=4096, vocab=32000, ffn=28672, **LLAMA),
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, seq=8192, vocab=128256, ffn=14336, **LLAMA),
    "llama3-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, seq=8192, vocab=128256, ffn=28672, **LLAMA),
}
# model, GPUs, GBS, MBS, TP, PP, CP, VP, tokens/s/GPU, model TFLOP/s/GPU (as published)
ROWS = [
    ("gpt3-175b", 128, 256, 1, 4, 8, 1, 6, 726, 782),
    ("gpt3-175b", 512, 2048, 2, 4, 8, 1, 6, 782, 842),
    ("llama2-7b", 8, 128, 1, 1, 1, 1, 1, 16847, 776),
    ("llama2-13b", 16, 128, 1, 1, 4, 1, 10, 8646, 754),
    ("llama2-70b", 64, 128, 1, 4, 4, 1, 20, 1707, 759),
    ("llama3-8b", 8, 128, 1, 1, 1, 2, 1, 12036, 697),
    ("llama3-70b", 64, 128, 1, 4, 4, 2, 5, 1533, 738),
]

# Transformer Engine's userbuffers TP overlap (ub_tp_comm_overlap) as the NeMo-Framework-Launcher's 24.07 training
# configs set it (launcher_scripts/conf/training/llama/llama2_70b.yaml, llama3_70b.yaml: true; gpt3/175b.yaml and
# 175b_fp8.yaml: false; the tp 1 rows have none to overlap)
# With ub_tp_comm_overlap False the GPT-3 rows still run Transformer Engine's async dgrad reduce-scatter beside the
# wgrad GEMM (mcore_gpt, transformer_engine, sequence_parallel True in both files): "bulk" (tensor_parallel.py)
TP_OVERLAP = {"llama2-70b": "ring", "llama3-70b": "ring", "gpt3-175b": "bulk"}


def _row(name, gpus, gbs, mbs, tp, pp, cp, vp, tokens, tflops):
    m = gpt_stats(GPTShape(**SHAPES[name]), name)
    c = make_cluster("h100-sxm", 8, gpus // 8, inter="ib-ndr", nics_per_node=8)
    s = Strategy(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, zero=1, micro_batch=mbs,
                 schedule="interleaved" if vp > 1 else "1f1b", virtual=vp, ranks_per_node=8)
    t = Training(global_batch=gbs, precision="fp8", optimizer="adam", overlap_param_gather=True, attention_kernel="cudnn",
                 tp_overlap=TP_OVERLAP.get(name, "none"), overlap_p2p=True)   # overlap_p2p_comm True in every config
    p = evaluate(m, c, t, s)
    return m, p, gbs * m.gpt.seq / p.step_s / gpus


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_model_flops_per_token_match_the_table(row):
    m, _, _ = _row(*row)
    assert m.flops_per_sample / m.gpt.seq == pytest.approx(row[-1] / row[-2] * 1e12, rel=0.001)


def test_tokens_per_gpu_within_the_issue_tolerance():
    errs = {f"{r[0]}-{r[1]}": _row(*r)[2] / r[-2] - 1 for r in ROWS}
    assert median(abs(e) for e in errs.values()) <= 0.10, errs
    assert max(abs(e) for e in errs.values()) <= 0.25, errs


def test_every_published_row_fits_with_fused_attention():
    for r in ROWS:
        _, p, _ = _row(*r)
        assert p.memory.fits, (r, p.memory.total / 2**30)


def test_context_parallel_rows_pass_kv_around_the_ring_hidden():
    """At 4096 tokens a GPU the K/V sends hide behind the block's attention on NVLink (cp 2 inside a node)."""
    for r in ROWS[-2:]:
        _, p, _ = _row(*r)
        ring = next(o for o in p.comm if o.name == "cp-ring")
        assert ring.time_s > 0 and ring.exposed_s == 0.0 and ring.group.nodes == 1
