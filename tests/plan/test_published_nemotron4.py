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
batch as the row, BF16, Adam, ZeRO-1 (the distributed optimizer) with bucketed reduce-scatter and
--overlap-param-gather, the interleaved schedule. Unstated in the report, taken from the run's own launcher
configuration: NVIDIA/NeMo-Framework-Launcher's launcher_scripts/conf/training/nemotron/nemotron_340b.yaml,
committed 2024-06-17 as "actual GPU/GBS numbers used in pretraining" (7c842fcd), is Table 2's 6,144-GPU row (768
nodes, batch 2304, TP 8, PP 12, VP 8, CP 1, micro-batch 1, sequence parallel, Megatron-core on Transformer Engine)
and sets: virtual stages 8, hence one layer a chunk and 8 on every stage (the planner's default split for an
interleaved schedule is now Megatron's even split, stages.py: no --stage-layers needed); ub_tp_comm_overlap False,
under which Transformer Engine's layers still launch the column-parallel dgrad reduce-scatter async beside the wgrad
GEMM (TE v1.7 layernorm_linear.py, "Overlap dgrad-RS/AR with wgrad"): --tp-overlap bulk, the forward collectives and
the backward all-gathers exposed; activations_checkpoint_granularity selective (--recompute selective: the attention
core recomputed); optim distributed_fused_adam with grad_sync_dtype bf16 (--grad-reduce bf16), overlap_grad_sync and
overlap_param_sync on, bucket_cap_mb 50; overlap_p2p_comm False and batch_p2p_comm True, i.e. the blocking,
synchronised p2p calls the planner's pp-p2p count models (Megatron-core core_r0.7.0 pipeline_parallel/schedules.py
and p2p_communication.py: one batch_isend_irecv + torch.cuda.synchronize() per warm-up forward, 1F1B pair and
cool-down backward, as in the Megatron-LM MegaScale ran; tests/plan/megatron_schedule.py). cuDNN fused attention
(Transformer Engine's, which Megatron-core runs on H100); micro-batch 1; the loss unfused (Training(fused_loss=False):
Megatron-core core_r0.7.0 language_module.py computes vocab_parallel_cross_entropy(logits.float(), labels), and the
file sets no cross_entropy_loss_fusion; +0.06 points). The output layer is one ColumnParallelLinear over the tp
ranks (core_r0.7.0 gpt_model.py), 2 x 18432 x 256000 / 8 FLOPs a token as the planner counts it.

Measured when written (FP32 reduction, no recompute, --tp-overlap none, stages given): +13.3%, +13.5%, +11.5%;
with the fill's tensor-parallel communication +13.6/+13.7/+11.9%. With the configuration's terms as above:
+11.3%, +11.4%, +9.1% (1,536, 3,072, 6,144 GPUs): median 11.3%, max 11.4%, every row SLOW. Step by step (1,536
GPUs): the dgrad reduce-scatter beside the wgrad GEMM -2.2 points (0.66 -> 0.50 s of tensor-parallel time at 6,144
GPUs), the BF16 reduction -1.6 (dp-grad exposed 0.20 -> 0.03 s), selective recompute +1.5 (the attention core's
forward again), the unfused loss +0.06. KNOWN MISS on the median (the max is within the issue's 25%), pinned just
above. Sensitivity to V:
4 gives +12.1/+12.2/+10.6%, 2 gives +16.3/+16.5/+16.3%. The model FLOPs per step the table implies (MFU x 989.4
TFLOP/s x iteration time) match the planner's count to 0.4% on every row (test below), so the miss is in time,
not FLOPs.

Where the time goes (6,144 GPUs, V 8, 8.73 s against 8.0): compute 7.53 s on the slowest stage, x 1.142 the mean
stage: the last stage holds the 256,000-word output layer (1.31 layers' FLOPs) on top of its 8 layers (+0.93 s);
the tensor-parallel collectives exposed 0.50 s (1,152 x 0.574 ms all-reduce equivalents, the backward dgrad
reduce-scatters hidden); the blocking p2p 0.30 s (752 calls of 18.9 MB across nodes); the data-parallel
reduce-scatter and all-gather 0.13 s; the bubble 0.27 s. Term at fault: the last stage's output layer under the
even split the run used (Megatron-core of mid-2024 has no uneven split: get_num_layers_to_build divides evenly;
its output layer is one column-parallel GEMM split over tp like any other, its cross-entropy unfused in this
configuration, so nothing in the sources makes that stage cheaper than its FLOPs) and the H100 linear-layer share.
Not taken: --tp-overlap ring (userbuffers), which the configuration turns off (it would give +5.2/+5.3/+3.1%).
"""

from statistics import median

import pytest

from tandem.plan.cost import evaluate, validate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

NEMOTRON4_340B = GPTShape(layers=96, hidden=18432, heads=96, kv_heads=8, ffn=73728, seq=4096, vocab=256000,
                          gated=False, bias=False, tied=False, learned_pos=False)
TP, PP, VIRTUAL = 8, 12, 8
# DP size, GPUs, batch, iteration time (s), MFU (Table 2)
TABLE_2 = [(16, 1536, 768, 10.3, 0.424), (32, 3072, 1536, 10.3, 0.423), (64, 6144, 2304, 8.0, 0.410)]
H100_BF16_PEAK = 989.4e12   # the report's 989 TFLOP/s


def _plan(dp, gpus, batch, virtual=VIRTUAL):
    m = gpt_stats(NEMOTRON4_340B, "nemotron4-340b")
    c = make_cluster("h100-sxm", 8, gpus // 8, inter="ib-ndr", nics_per_node=8)
    # nemotron_340b.yaml (module docstring): ub_tp_comm_overlap False, so Transformer Engine's own async dgrad
    # reduce-scatter beside the wgrad GEMM ("bulk"); grad_sync_dtype bf16; selective activation recompute
    t = Training(global_batch=batch, precision="bf16", optimizer="adam", overlap_param_gather=True,
                 attention_kernel="cudnn", tp_overlap="bulk", grad_reduce="bf16", fused_loss=False)
    # no stage counts: the planner's default for 12 stages x V is Megatron's even split, 8 layers a stage
    s = Strategy(dp=dp, tp=TP, pp=PP, zero=1, micro_batch=1, schedule="interleaved", virtual=virtual,
                 ranks_per_node=8, recompute="selective")
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
    """KNOWN MISS on the median: 11.3% (max 11.4%, within 25%), every row slow; pinned just above. Term at fault:
    the last stage's 256k-word output layer on the even split the run used; not userbuffers tensor-parallel
    overlap, which the run's launcher configuration turns off (ub_tp_comm_overlap: False; module docstring)."""
    errs = errors()
    assert all(e > 0 for e in errs.values()), errs
    assert median(errs.values()) <= 0.115, errs
    assert max(errs.values()) <= 0.115, errs


def test_last_stage_sets_the_pace():
    """Megatron's even split (the planner's default at 12 x 8) leaves the output layer's 1.31 layers of FLOPs on the
    last stage: x 1.142 the mean stage with the selective recompute's attention forward in every layer."""
    p = _plan(*TABLE_2[-1][:3])
    assert p.stage_layers == (8,) * 12
    assert p.stage_imbalance == pytest.approx(1.142, abs=0.002)
    assert p.bubble_s / p.step_s < 0.035   # interleaving at V 8 leaves little bubble


@pytest.mark.parametrize("virtual", [2, 4])
def test_other_virtual_stages_known_miss(virtual):
    """Other V than the configuration's 8: 4 gives +12.1/+12.2/+10.6%, 2 gives +16.3..+16.5% (still every row slow),
    its bubble being the largest."""
    errs = errors(virtual)
    assert all(e > 0 for e in errs.values()), errs
    assert max(errs.values()) <= {2: 0.17, 4: 0.125}[virtual], errs
