"""Iteration time at 1,536 to 6,144 GPUs: NVIDIA, "Nemotron-4 340B Technical Report" (arXiv:2406.11704), §2.2-2.3
and Table 2 (the batch-size ramp): data-parallel size 16 / 32 / 64 on 1,536 / 3,072 / 6,144 H100s, batch 768 /
1536 / 2304, iteration time 10.3 / 10.3 / 8.0 s, MFU 42.4 / 42.3 / 41.0%. Training ran on 768 DGX H100 nodes
(8 x H100 80GB SXM5 on NVLink/NVSwitch, 989 TFLOP/s BF16 each, 8 x 400 Gb/s InfiniBand HCAs a node) with 8-way
tensor parallelism, 12-way pipeline parallelism with interleaving, data parallelism, and a distributed optimizer
sharding the optimizer state over the data-parallel replicas. The model (Table 1): 96 layers, hidden 18432,
96 heads, 8 KV heads, sequence 4096, vocabulary 256,000, squared-ReLU MLP (not gated), no bias, untied
embeddings, RoPE; 9.4B embedding and 331.6B other parameters, which set the MLP width: 73728 (= 4 x hidden; the
report does not print it). Table 2 was read from two independent transcriptions of the report in the stored
corpus (find_string "768 DGX H100": a Russian paper summary and an English technical walk-through agree row for
row); a third page quotes the 6,144-GPU row (batch 2304, 8.0 s) and "41-42%" MFU.

The planner gets the stated layout: h100-sxm, 8 a node, 8 x ib-ndr (400 Gb/s), TP 8 / PP 12 / DP as the row,
batch as the row, BF16, Adam, ZeRO-1 (the distributed optimizer) with Megatron's bucketed reduce-scatter and
--overlap-param-gather, the interleaved schedule. Unstated, chosen from sources and named here: the virtual
stages, 8 (NVIDIA's NeMo recipe for this model on 768 nodes, nemo/collections/llm/recipes/nemotron4_340b.py:
TP 8, PP 12, VP 8, micro-batch 1; it also sets CP 2, which Table 2's 8 x 12 x DP = GPUs rules out), hence 8
layers on every stage (Megatron-LM's even split; V 8 needs it: 96 = 12 x 8 x 1); micro-batch 1 (the recipe);
no recompute (the recipe has none); cuDNN fused attention (Transformer Engine's, which Megatron-core runs on
H100); gradients reduce-scattered in FP32 (Megatron-LM's default for BF16, which the recipe's default keeps).

Measured (as merged, with the fill's tensor-parallel communication): +13.6%, +13.7%, +11.9% (1,536, 3,072, 6,144
GPUs): median 13.6%, max 13.7%, every row SLOW. KNOWN MISS on the median (the max is within the issue's 25%), pinned just above. Sensitivity to the
unstated V: 4 gives +14.3/+14.5/+13.3%, 2 gives +18.6..+19.1%; the planner's own split (8 x 10, 9, 7) at V 4
+12.5/+12.6/+11.6%; 1F1B +26.6..+30.2%. The model FLOPs per step the table implies (MFU x 989.4 TFLOP/s x
iteration time) match the planner's count to 0.4% on every row (test below), so the miss is in time, not FLOPs.

Where the time goes (6,144 GPUs, V 8, 8.948 s against 8.0): compute 6.46 s at the mean stage, x 1.148 on the last
stage, which holds the 256,000-word output layer (1.31 layers' FLOPs) on top of its 8 layers (+0.96 s); the
tensor-parallel all-reduces exposed in full (1,152 x 0.57 ms = 0.66 s); the FP32 reduce-scatter and the parameter
all-gather partly exposed (0.30 s); the pipeline's p2p sends exposed (752 calls, 0.30 s); the bubble 0.268 s
(0.243 s compute + 0.025 s of the tensor-parallel communication the fill repeats). Term at fault: the last stage's output layer under an even
split (the report does not say how the layers were split).

Tensor-parallel overlap (--tp-overlap, tandem/plan/tp_overlap.py): NONE, as the run's own configuration states.
NVIDIA/NeMo-Framework-Launcher's launcher_scripts/conf/training/nemotron/nemotron_340b.yaml, committed 2024-06-17
as "actual GPU/GBS numbers used in pretraining" (7c842fcd) and unchanged in the 24.07 tag, is Table 2's 6,144-GPU
row (768 nodes, batch 2304, TP 8, PP 12, VP 8, CP 1, micro-batch 1, sequence parallel) and sets
ub_tp_comm_overlap: False (NeMo 2.0's recipe turns tp_comm_overlap on only in its performance mode). With
--tp-overlap ring the rows would come out +5.3/+5.5/+3.8%, a pass obtained against the source, so not taken. The
same file also sets selective activation recompute and grad_sync_dtype bf16 (NeMo's distributed_fused_adam), which
this test does not take (FP32 reduction, no recompute): with both the rows are +13.5/+13.6/+11.2%, about as now.
"""

from statistics import median

import pytest

from tandem.plan.config import Strategy, Training
from tandem.plan.cost import evaluate, validate
from tandem.plan.hardware import make_cluster
from tandem.plan.model import GPTShape, gpt_stats

NEMOTRON4_340B = GPTShape(layers=96, hidden=18432, heads=96, kv_heads=8, ffn=73728, seq=4096, vocab=256000,
                          gated=False, bias=False, tied=False, learned_pos=False)
TP, PP, VIRTUAL = 8, 12, 8
# DP size, GPUs, batch, iteration time (s), MFU (Table 2)
TABLE_2 = [(16, 1536, 768, 10.3, 0.424), (32, 3072, 1536, 10.3, 0.423), (64, 6144, 2304, 8.0, 0.410)]
H100_BF16_PEAK = 989.4e12   # the report's 989 TFLOP/s


def _plan(dp, gpus, batch, virtual=VIRTUAL):
    m = gpt_stats(NEMOTRON4_340B, "nemotron4-340b")
    c = make_cluster("h100-sxm", 8, gpus // 8, inter="ib-ndr", nics_per_node=8)
    t = Training(global_batch=batch, precision="bf16", optimizer="adam", overlap_param_gather=True,
                 attention_kernel="cudnn", tp_overlap="none")   # ub_tp_comm_overlap: False (module docstring)
    s = Strategy(dp=dp, tp=TP, pp=PP, zero=1, micro_batch=1, schedule="interleaved", virtual=virtual,
                 ranks_per_node=8, stage_layers=(NEMOTRON4_340B.layers // PP,) * PP)
    validate(m, c, t, s)
    return evaluate(m, c, t, s)


def errors(virtual=VIRTUAL) -> dict[int, float]:
    return {gpus: _plan(dp, gpus, batch, virtual).step_s / it - 1 for dp, gpus, batch, it, _ in TABLE_2}


def SCOREBOARD() -> dict[str, dict]:
    return {"nemotron-4 340B": errors()}


def test_parameters_and_model_flops_match_the_report():
    m = gpt_stats(NEMOTRON4_340B, "nemotron4-340b")
    emb = 2 * NEMOTRON4_340B.vocab * NEMOTRON4_340B.hidden   # untied: input and output
    assert emb / 1e9 == pytest.approx(9.4, abs=0.05)
    assert (m.params - emb) / 1e9 == pytest.approx(331.6, abs=0.1)
    for dp, gpus, batch, it, mfu in TABLE_2:
        p = _plan(dp, gpus, batch)
        assert p.model_flops_per_gpu == pytest.approx(mfu * H100_BF16_PEAK * it, rel=0.006), gpus
        assert p.memory.fits, (gpus, p.memory.total / 2**30)


def test_iteration_time_known_miss():
    """KNOWN MISS on the median: 13.6% (max 13.7%, within 25%), every row slow; pinned just above. Term at fault:
    the last stage's 256k-word output layer on an even split; not tensor-parallel overlap, which the run's launcher
    configuration turns off (ub_tp_comm_overlap: False; module docstring)."""
    errs = errors()
    assert all(e > 0 for e in errs.values()), errs
    assert median(errs.values()) <= 0.14, errs
    assert max(errs.values()) <= 0.14, errs


def test_last_stage_sets_the_pace():
    """The even split leaves the output layer's 1.31 layers of FLOPs on the last stage: 9.31 / (97.31 / 12)."""
    p = _plan(*TABLE_2[-1][:3])
    assert p.stage_imbalance == pytest.approx(1.148, abs=0.002)
    assert p.bubble_s / p.step_s < 0.03   # interleaving at V 8 leaves little bubble


@pytest.mark.parametrize("virtual", [2, 4])
def test_other_virtual_stages_known_miss(virtual):
    """The unstated V (as merged, with the fill's tensor-parallel communication, model_parallel.py): 4 gives
    +14.3/+14.5/+13.3%, 2 gives +18.6..+19.1% (still every row slow), V 2's bubble being the largest."""
    errs = errors(virtual)
    assert all(e > 0 for e in errs.values()), errs
    assert max(errs.values()) <= {2: 0.20, 4: 0.15}[virtual], errs
