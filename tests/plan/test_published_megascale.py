"""Step time at 256 to 12,288 GPUs: Jiang et al., "MegaScale: Scaling Large Language Model Training to More Than
10,000 GPUs" (ByteDance, NSDI 2024, arXiv:2402.15627), Table 2, the Megatron-LM rows (the paper's own baseline
runs: 175B model, Table 1's shape, 128 heads, hidden 12288, 96 layers, TP 8, PP 8; batch 768 on 256-1024 GPUs and
6144 on 3072-12288; Ampere GPUs, 8 x 200 Gb/s NICs a node), Iter Time (s) as the expected number. The rows were
read from a structured transcription of the paper in the stored corpus (find_string "Megatron-LM | 12288"); its
headline row (12,288 GPUs: MegaScale 55.2% MFU, 1.34x Megatron-LM's 41.2%) agrees with the paper's abstract.
The MegaScale rows themselves are not used: parallel transformer blocks, sliding-window attention and LAMB
change the model, which the planner does not describe.

The planner gets A100-80GB, 8 a node, 8 x roce-200, the shape (sequence 2,048 and vocabulary 64,000: §6.1 "Sequence
length is 2,048 and vocabulary size is 64,000 for all the cases"; 51,200, GPT-3's, before that sentence was read),
TP 8 / PP 8 / dp the rest, micro-batch 1, bf16, Adam, ZeRO-1 (Megatron's distributed optimizer) with data-parallel
communication NOT overlapped (--overlap 0: MegaScale's Table 3 lists "DP overlap" among its own additions over this
baseline), the interleaved 1F1B schedule with 6 virtual stages (§6.1: "six and three interleaving stages for the
175B and 530B models"; it was taken from NVIDIA's GPT-3 175B recipe before that sentence was read), its default
efficiency, and FlashAttention 1 (--attention-kernel fa1: §3.3 names FlashAttention-2 as MegaScale's own operator
over the baseline, and the commit §6.1 names, 285068c8, is Megatron-LM's merge of FlashAttention 1 as
--use-flash-attn; FlashAttention-2 was planned here before that was read). One input is unstated and was chosen
before comparing: no recompute. It hardly matters: under --use-flash-attn, 285068c8's selective recompute does
nothing (transformer.py checkpoints core attention only on the unfused path), and full recompute puts every row
slow (+9% to +27%) and the slope a third above the table's. Unstated and kept: BF16 (the commit's examples/pretrain_gpt3_175B.sh says --fp16,
but that script is stale: flags the commit no longer parses, a 20.12 container), micro-batch 1 (that script's).

Input audit (issue 14; the torchtitan 405B rows' miss was a wrong input): shape, heads, TP/PP (Table 1), sequence
and vocabulary (§6.1), batch per row (Table 2: 768 and 6144, a throughput measurement, no ramp-up; its tokens/s
are 768 x 2048 / Iter Time and its MFU is 1.077 TFLOP a token, the model FLOPs without recompute at vocabulary
64,000), 8 x 200 Gb/s NICs a node (§3.6), virtual stages (§6.1), Adam (Table 3 row 9 adds LAMB), no DP overlap
(Table 3 row 6) were checked and kept; "Ampere GPUs" is all the paper says of the GPU (A100-80GB kept: no source
for another variant); the attention kernel was wrong (FlashAttention-2, now 1: median 14.5% -> 11.8%, max 18.8%
-> 16.4%, and the time a micro-batch now within 1% of the table's).

Measured on main when written: median 9.5%, max 19.6%, all rows predicted SLOW (+20% at 256 GPUs, 0% at
12,288). With the per-architecture compute model: median 12.6%, max 19.2%, all rows FAST. With Megatron-LM's BF16
gradients reduce-scattered in FP32 (collectives.grad_reduce_bytes: its arguments.py forces
accumulate_allreduce_grads_in_fp32 for --bf16): median 11.5%, max 16.5%, all rows fast, -4.5% at 256 GPUs to
-16.5% at 12,288. With A100 unfused attention at its measured 0.156 of peak and FlashAttention-2 as MegaScale runs
it: median 15.2%, max 19.8%. With the paper's vocabulary (64,000), the fill and drain repeating each micro-batch's
tensor-parallel all-reduces and the tied embedding's gradient all-reduced between the first and last stage
(pipeline.py): median 14.5%, max 18.8%, every row fast (-8.0% at 256 GPUs to -18.8% at 12,288). With the
baseline's FlashAttention 1 instead of MegaScale's FlashAttention-2: median 11.8%, max 16.4% (-5.0% at 256 GPUs to
-16.4% at 12,288). Table 3's baseline (256 GPUs, batch 256, 47.7% MFU, i.e. 40.0 s x 256/768 x 53.0/47.7 = 14.8 s a
step): 13.2 s, -10.8% (12.8 s, -13.6% with FlashAttention-2).

Where the error that grows with scale comes from (test_fixed_time_per_step_known_miss): fit step = a x m + b over
the four batch-768 rows (m = 768 / dp micro-batches per step, 192 down to 48; tp, pp and the stage's work fixed).
The table gives a = 0.195 s a micro-batch and b = 2.61 s a step; the planner a = 0.193 s (1% under; 0.187 s with
FlashAttention-2) and b = 0.97 s.
The table's b is flat in dp (residuals at its own a: 2.74, 2.57, 2.78, 2.58 s for dp 4, 8, 12, 16; Table 3's
batch-256 run gives 2.36 s at dp 4), so ~1.65 s a step is missing that does not depend on data parallelism.

What Megatron-LM 285068c8 (the commit §6.1 names) does once a step, read in its source, and what it costs here:
- the pipeline's warm-up and cool-down: each chunk forward/backward ends in one blocking batched send/recv +
  torch.cuda.synchronize() (p2p_communication._communicate); §3.2's "PP overlap" decouples them. A discrete-event
  model of that schedule (tests/plan/megatron_schedule.py, test_megatron_schedule.py) takes exactly the planner's
  compute + fill and drain without transfer time, and its transfers on the critical path are 0.90 of the planner's
  2 (m + p - 1) v sends (2,388 at m = 192): nothing a step is missing there. Table 3 prices PP overlap at ~0.55 s at
  m = 64, 2.4x the planner's whole p2p there (0.23 s): a cost per blocking call beyond its transfer (the sync, the
  wait for the slower neighbour), hence per micro-batch, not per step;
- the distributed optimizer's reduce-scatter (FP32 grad buffer, one call a model chunk) and bf16 all-gather, not
  overlapped in that version: charged in full (0.53 s at dp 4, 0.70 s at dp 192);
- the tied embedding's gradient all-reduce between the first and last stage (optimizer.py
  allreduce_word_embedding_grads, FP32 main_grad, 393 MB): 16 ms, now charged; the fill's TP all-reduces: 24 ms,
  now charged;
- the optimizer step on the ZeRO shard: 18 ms at dp 4 (bandwidth_bound.py); the grad-norm all-reduce of one float over
  the world and the layer-norm grads over tp: microseconds to a millisecond;
- data: get_batch runs per micro-batch and chunk (next() and a broadcast over tp), so it is per micro-batch. §3.4
  says loading leaves "non-negligible GPU idle time at the beginning of each training step" without a number, and
  Table 3's "misc" (~0.2 s) also holds the straggling code of §6.3 (garbage collection).
None of these comes near 1.65 s. MegaScale's own rows (Table 2, the same fabric, with PP and DP overlap and its
data pipeline) fit a = 0.160 s and b = 1.19 s over the same batch-768 rows: ~1 s a step beyond their bubble
(7/6 x 0.16 = 0.19 s) and unhidden first all-gather / last reduce-scatter survives every overlap, and the
batch-6144 rows fit a = 0.212 s (9% above the batch-768 rows' for the same stage work) and b = 1.70 s: the time a
step grows with the job's size as synchronisation skew would (§6.3: stragglers, garbage collection, reduce-scatter
launch skew), which the planner leaves out ("stragglers and network congestion"); no source read gives it a size.

Tensor-parallel overlap (session 8, the lead's merge): the baseline commit overlaps the column-parallel backward
all-reduce / reduce-scatter with the weight-gradient GEMM (285068c8, megatron/core/tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication.backward: async_op=True, then the wgrad GEMM, then handle.wait();
on unless --no-async-tensor-model-parallel-allreduce), which is --tp-overlap bulk. Planned so, as its source says,
although it moves the table away: median 14.1%, max 18.4% (11.8% / 16.4% with --tp-overlap none), every row fast;
the time a micro-batch 0.188 s against the table's 0.195 s, the fixed part 0.96 s against 2.61 s. Alternatives:
V 2 / 12 13.0% / 15.8%, 13.1% / 18.2%; selective recompute 8.0-9.2% / 11.1-14.2% (which 285068c8 does not run
under --use-flash-attn: an upper bound). Pinned at 15% / 19%.
"""

from statistics import median

import pytest

from tandem.plan.cost import evaluate, validate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training
from tests.plan.published_fit import fit

# Batch, GPUs, Iter Time (s), MFU (Megatron-LM rows of Table 2)
TABLE_2 = [(768, 256, 40.0, 0.530), (768, 512, 21.2, 0.499), (768, 768, 15.2, 0.467), (768, 1024, 11.9, 0.447),
           (6144, 3072, 29.02, 0.487), (6144, 6144, 14.78, 0.478), (6144, 8192, 12.24, 0.433),
           (6144, 12288, 8.57, 0.412)]
GPT_175B = GPTShape(layers=96, hidden=12288, heads=128, seq=2048, vocab=64000)   # §6.1


def errors(virtual: int = 6, recompute: str = "none") -> dict[int, float]:
    m = gpt_stats(GPT_175B, "megascale-175b")
    out = {}
    for batch, gpus, iter_s, _ in TABLE_2:
        c = make_cluster("a100-80gb", 8, gpus // 8, inter="roce-200", nics_per_node=8)
        # The baseline's kernel is FlashAttention 1, not 2: §3.3 lists FlashAttention-2 among MegaScale's own
        # operators over the baseline (Table 3 row 7), and §6.1's commit 285068c8 is Megatron-LM's "Merge branch
        # 'tridao-flashattn'", which adds --use-flash-attn calling flash_attn 1.x's flash_attn_unpadded_func
        # (megatron/model/transformer.py FlashSelfAttention); the paper chose that commit for its "feature set".
        t = Training(global_batch=batch, precision="bf16", optimizer="adam", overlap=0.0, attention_kernel="fa1", runtime="megatron",
                     tp_overlap="bulk")   # 285068c8's async dgrad reduce-scatter beside the wgrad GEMM (docstring)
        s = Strategy(dp=gpus // 64, tp=8, pp=8, zero=1, micro_batch=1, schedule="interleaved", virtual=virtual,
                     recompute=recompute, ranks_per_node=8)
        validate(m, c, t, s)
        p = evaluate(m, c, t, s)
        assert p.memory.fits, (gpus, p.memory.total / 2**30)
        out[gpus] = p.step_s / iter_s - 1
    return out


def test_step_time_known_miss():
    """KNOWN MISS. Since the achievable link rates and the A100 attention factor: median 12.2%, max 22.5%, every row
    predicted slow (9.5% / 19.6% before them). With the per-architecture compute model (efficiency.py: A100 linear
    layers at 0.67 of peak from the FlashAttention-2 paper's end-to-end runs, not fitted): median 12.6%, max 19.2%,
    every row FAST. With BF16 gradients reduce-scattered in FP32 as Megatron-LM does: median 11.5%, max 16.5%
    (-4.5% at 256 GPUs ... -16.5% at 12,288): a per-step time independent of dp is missing (next test), not
    data-parallel communication. With the memory-bound ops charged apart and the A100 linear share re-derived
    without them (bandwidth_bound.py, efficiency.py 0.67 -> 0.71): median 15.0%, max 19.5%. With the attention-kernel
    model (FlashAttention-2 at its own 0.615 of A100 peak at 2048) as well: median 15.2%, max 19.8%. With the
    paper's vocabulary (64,000), the fill and drain repeating each micro-batch's TP all-reduces and the tied
    embedding's gradient all-reduce (pipeline.py): median 14.5%, max 18.8% (-8.0% at 256 GPUs to -18.8% at
    12,288). With the baseline's kernel, FlashAttention 1 (the input audit, module docstring): median 11.8%, max 16.4%
    (-5.0% ... -16.4%). With --tp-overlap bulk (285068c8's sequence-parallel layers overlap the dgrad reduce-scatter
    with the wgrad GEMM): measured median 14.1%, max 18.4% (-7.4% at 256 GPUs ... -18.4% at 12,288). Pinned just
    above; the module docstring lists what Megatron-LM does once a step and its size."""
    errs = {k: abs(e) for k, e in errors().items()}
    assert median(errs.values()) <= 0.15, errs
    assert max(errs.values()) <= 0.19, errs


def test_fixed_time_per_step_known_miss():
    """KNOWN MISS, located: the planner's time a micro-batch matches the table's slope over the batch-768 rows, its
    time a step independent of the micro-batch count is a third of the table's, and neither the table's nor the
    planner's fixed part grows with data parallelism (module docstring)."""
    errs = errors()
    rows = [(b // (g // 64), it, it * (1 + errs[g])) for b, g, it, _ in TABLE_2 if b == 768]
    a_t, b_t = fit([r[0] for r in rows], [r[1] for r in rows])
    a_p, b_p = fit([r[0] for r in rows], [r[2] for r in rows])
    assert a_t == pytest.approx(0.1946, abs=1e-4) and b_t == pytest.approx(2.61, abs=0.01)   # the table alone
    assert a_p == pytest.approx(a_t, rel=0.04)   # 0.188 against 0.195 (0.193 before the dgrad overlap)
    assert 0.34 <= b_p / b_t <= 0.40, (b_p, b_t)   # 0.97 / 2.61 = 0.37: ~1.65 s a step missing
    table_fixed = [it - a_t * m for m, it, _ in rows]
    plan_fixed = [it * (1 + errs[g]) - a_p * (b // (g // 64)) for b, g, it, _ in TABLE_2]
    assert max(table_fixed) - min(table_fixed) < 0.25, table_fixed         # dp 4 -> 16: flat
    assert max(plan_fixed) - min(plan_fixed) < 0.15, plan_fixed            # dp 4 -> 192: flat too


@pytest.mark.parametrize("virtual,recompute", [(2, "none"), (12, "none"), (2, "selective"), (6, "selective"),
                                               (12, "selective")])
def test_error_whatever_the_unstated_inputs_known_miss(virtual, recompute):
    """Recompute is not stated; 6 virtual stages is (§6.1), 2 and 12 show the error does not rest on it."""
    errs = {k: abs(e) for k, e in errors(virtual, recompute).items()}
    # known miss under these alternatives (with the selective rows at FlashAttention-2's speed, as MegaScale runs it:
    # median 12.1-14.4%, max 15.4-19.4%; with the paper's vocabulary and pipeline.py's fill and embedding
    # terms: 2, 12 virtual 13.4% / 16.2%, 13.5% / 18.6%; selective at 2, 6, 12: 11.3% / 14.2%, 12.4% / 17.0%,
    # 11.4% / 16.7% (median / max); with the baseline's FlashAttention 1: 2, 12 virtual 10.7% / 13.6%, 10.8% /
    # 16.2%; selective at 2, 6, 12: 5.7% / 9.0%, 7.0% / 12.2%, 6.0% / 12.0%; with --tp-overlap bulk (measured now):
    # 2, 12 virtual 13.0% / 15.8%, 13.1% / 18.2%; selective at 2, 6, 12: 8.0% / 11.1%, 9.2% / 14.2%, 8.3% / 14.0%.
    # Those selective rows charge a
    # recomputed attention that 285068c8 skips under --use-flash-attn (transformer.py checkpoints core attention
    # only on the unfused path): an upper bound, not the baseline)
    assert max(errs.values()) <= 0.19, errs
    assert median(errs.values()) <= 0.14, errs
