"""Throughput at 8,192 and 16,384 GPUs: Meta, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4, the
Llama 3 405B pre-training configurations (also on P. Balaji's SC'24 slide "Herding Llamas", as quoted at
glennklockwood.com/garden/llama-3.1): GPUs, TP, CP, PP, 16M tokens a batch, BF16, and the achieved model
TFLOP/s per GPU (430, 400, 380; MFU 43%, 41%, 38% against H100 SXM's 989 TFLOP/s).

The planner gets the 405B shape (126 layers, hidden 16384, 128 heads, 8 KV heads, ffn 53248, vocab 128256), H100
SXM 8 a node on 400 Gb/s RoCE per GPU (8 x roce-400, as the paper says), the row's TP/CP/PP with dp the rest,
sequence 8192 (131072 for the CP 16 row), global batch 16M tokens / sequence, micro-batch 1, ZeRO-2 as the
paper describes its FSDP (optimizer states and gradients sharded, parameters kept after forward) with the
gather overlapped, no recompute (not stated in the table: an assumption; every row then fits, 66 GiB),
flash attention, 1F1B over the planner's balanced uneven split (7, 8 x 14, 7), default efficiency. Nothing fitted.

KNOWN MISS (issue 14 asks 10% median, 25% max; measured on main when written): -27.0%, -39.9%, -34.7%: median
34.7%, max 39.9%, all SLOW. The term at fault is the pipeline schedule: with 16 micro-batches per rank on 16
stages (the 16,384-GPU rows) 1F1B idles (p-1)/(m+p-1) = 48% of the step (5.1 s of 11.2 s predicted at 16,384
GPUs). Meta ran an interleaved schedule with its own micro-batch count and virtual stages (paper §3.3.2),
which the planner cannot express here: it refuses interleaving of 126 layers (not divisible by pp x virtual)
and has no per-chunk uneven split (issue item 7). Without the bubble the two 8K rows come within the
issue's tolerance (checked below).

With the gradients reduce-scattered in FP32, as the paper says Meta's training does (§3.3.4, "reduce-scatter
gradients in FP32 across data parallel workers"; comm.grad_reduce_bytes): -32.7%, -43.9%, -37.5% (median 37.5%,
max 43.9%, from 37.4% / 40.9%): at 8,192 GPUs each micro-batch reduce-scatters 12.75 GB (6.4 GB in BF16),
0.264 s against 0.232 s of backward to hide behind, so 1.20 s a step is exposed instead of 0.09 s.
"""

from statistics import median

import pytest

from tandem.plan.config import Strategy, Training
from tandem.plan.cost import evaluate, validate
from tandem.plan.hardware import make_cluster
from tandem.plan.model import GPTShape, gpt_stats

SHAPE = dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, gated=True, bias=False,
             norm="rmsnorm", tied=False, learned_pos=False)
# GPUs, TP, CP, PP, sequence, achieved TFLOP/s per GPU (Table 4)
TABLE_4 = [(8192, 8, 1, 16, 8192, 430), (16384, 8, 1, 16, 8192, 400), (16384, 8, 16, 16, 131072, 380)]
TOKENS_PER_BATCH = 16 * 1024**2
KNOWN_MISS = (0.39, 0.45)   # (median, max) pinned: see KNOWN MISS above


def _plan(gpus, tp, cp, pp, seq, _):
    m = gpt_stats(GPTShape(seq=seq, **SHAPE), "llama3-405b")
    c = make_cluster("h100-sxm", 8, gpus // 8, inter="roce-400", nics_per_node=8)
    t = Training(global_batch=TOKENS_PER_BATCH // seq, precision="bf16", optimizer="adamw", flash_attention=True,
                 overlap_param_gather=True)
    s = Strategy(dp=gpus // (tp * cp * pp), tp=tp, pp=pp, cp=cp, zero=2, micro_batch=1, ranks_per_node=8)
    validate(m, c, t, s)
    return evaluate(m, c, t, s)


def errors() -> dict[int, float]:
    out = {}
    for row in TABLE_4:
        p = _plan(*row)
        assert p.memory.fits, (row, p.memory.total / 2**30)
        out[f"{row[0]} cp{row[2]}"] = p.tflops_per_gpu / row[-1] - 1
    return out


def test_model_tflops_per_gpu_known_miss():
    errs = {k: abs(e) for k, e in errors().items()}
    assert median(errs.values()) <= KNOWN_MISS[0], errs
    assert max(errs.values()) <= KNOWN_MISS[1], errs


def test_the_miss_is_the_pipeline_bubble():
    """Take the bubble out and the two 8K-sequence rows land within the issue's tolerance: what is left of the
    miss is the schedule, not compute or communication."""
    for row in TABLE_4[:2]:
        p = _plan(*row)
        without = p.tflops_per_gpu * p.step_s / (p.step_s - p.bubble_s)
        assert abs(without / row[-1] - 1) <= 0.25, (row, without)


@pytest.mark.parametrize("row", TABLE_4, ids=[f"{r[0]}-cp{r[2]}" for r in TABLE_4])
def test_gpu_count_and_batch_are_the_papers(row):
    gpus, tp, cp, pp, seq, _ = row
    p = _plan(*row)
    assert p.strategy.world == gpus and p.training.global_batch * seq == TOKENS_PER_BATCH
