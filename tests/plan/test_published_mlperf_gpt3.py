"""Step time at 512 to 10,752 GPUs: MLPerf Training v3.1 (MLCommons, November 2023), closed division, the GPT-3
175B benchmark, every submission of NVIDIA's Eos (DGX H100, 8 x H100 SXM and 8 x 400 Gb/s NDR InfiniBand a node)
and Azure's ND H100 v5 (the same GPUs and NICs a VM), as published in github.com/mlcommons/training_results_v3.1:
NVIDIA/results/eos_n64, eos_n96, eos-dfw_n512 ... eos-dfw_n1344 (_ngc23.09_nemo/gpt3/result_{0,1,2}.txt) and
Azure+NVIDIA/results/ND_H100_v5_n1344_pytorch/gpt3. Each log has one ``:::MLLOG`` line a training step, key
``tracked_stats``, value ``train_step_timing`` (seconds, NeMo's step timer around forward, backward and optimizer
step), and its ``global_batch_size`` and ``gradient_accumulation_steps``. The expected number of a row is the median
over its three runs of each run's median step (156-288 steps a run; the runs agree to 0.1%, Azure's to 1%). The
64-node row's config file (config_DGXH100_64x8x192x4x8_mbs1.sh) says MINIBS 192, its logs a batch of 2,048 (128
micro-batches): the logs are what ran.

The planner gets what the submission's own files say (NVIDIA/benchmarks/gpt3/implementations/pytorch):
- the shape, GPT-3 175B: 96 layers, hidden 12288, 96 heads, ffn 4h, sequence 2048 (conf/custom.yaml), learned
  positions and a tied output layer (NeMo's megatron_gpt_config defaults), dropout 0.0 (custom.yaml); vocabulary
  50,688: the benchmark's SentencePiece model has 50,257 tokens (the reference's PassThroughVocabulary(size=50257))
  and Megatron pads it to a multiple of 128 x tp (make_vocab_size_divisible_by 128);
- TP 4, PP 8, dp the rest, micro-batch 1 (config_DGXH100_<nodes>x8x<minibs>x4x8_mbs1.sh), the batch the log gives,
  the interleaved schedule with 12 virtual stages (custom.yaml: virtual_pipeline_model_parallel_size
  INTERLEAVED_PIPELINE, default 12, set by no config), sequence parallelism, no activation recompute;
- FP8 on the linear layers (config_fp8.sh: FP8 True, hybrid), BF16 attention;
- the distributed optimizer (config_common.sh: USE_DIST_OPTIMIZER True; run_and_time.sh maps it to
  optim@model.optim=distributed_fused_adam: Adam states sharded over
  dp, ZeRO-1 here as NeMo's test_published_nemo_fp8), its gradient reduce-scatter and parameter all-gather
  overlapped (conf/optim/distributed_fused_adam.yaml: overlap_grad_sync, overlap_param_sync True), gradients
  reduced in BF16 (grad_sync_dtype: bf16);
- the interleaved schedule's sends posted async (custom.yaml: overlap_p2p_comm True, batch_p2p_comm False; set by
  no config): ``--overlap-p2p`` (pipeline.py), as Megatron-core df727128 (the Dockerfile's MEGATRON_REVISION)
  runs it;
- Transformer Engine's userbuffers TP overlap on (TP_COMM_OVERLAP True, conf/tp_overlap/h100tp4pp8mbs1.yaml:
  ring_exchange for qkv/fc1 fprop and proj/fc2 dgrad, pipeline in 4 splits for proj/fc2 fprop, bulk for the qkv/fc1
  dgrad and wgrad): tensor_parallel.py's ``ring``. config_common.sh also sets NVTE_UB_ATOMIC_GEMM_RS=1 and
  NVTE_RS_STRIDED_ATOMIC=1, which likely run the proj/fc2 forward reduce-scatter as an FP8 atomic GEMM rather than
  the 4-split pipeline ``ring`` times (not modelled: ~10 ms of exposed TP time a step at m = 16);
- attention: FlashAttention-2. The Dockerfile pins Transformer Engine 09ba8427 and installs flash-attn 2.0.8; at
  that commit DotProductAttention takes flash-attn first whenever it is enabled (NVTE_FLASH_ATTN defaults to 1, which
  config_common.sh leaves commented out), the GPU is sm80+, the inputs are 16-bit and execution is not forced
  deterministic (NVTE_ALLOW_NONDETERMINISTIC_ALGO defaults to 1); cuDNN's fused attention is its second choice.
  Azure's Dockerfile pins Transformer Engine 4ee8e8ec, whose attention.py makes the same choice in the same order.
  config_common.sh also sets NCCL_NVLS_ENABLE=0: NVLink SHARP is off, which moves nothing here (the planner would
  offer NVLS only to the 4-GPU TP all-reduce inside a node, where the ring is faster).
Nothing fitted; the planner's default efficiency. Set by the configs and not modelled (each shapes how well
communication overlaps compute): MEGATRON_CORE_{P2P,DP,TP}_MAX_CTAS 2 / 8 / 8, NCCL_MIN_NCHANNELS 4,
NCCL_P2P_NET_CHUNKSIZE 2 MB, the LayerNorm kernels' SM margin of 8, CUDA_DEVICE_MAX_CONNECTIONS 1.

Measured when written (the planner at main 23ef241, session 9), before --overlap-p2p existed (every send charged as
blocking): every row slow, +4.6% (768 GPUs) to +10.4% (10,240 GPUs), Azure's 10,752 +8.2%; median 7.0%, max 10.4%,
within issue 14's 10% / 25%. Honest order of events: that first run (the seven NVIDIA rows, vocabulary 51,200)
planned every kernel and tp-overlap mode at once (cuDNN 5.4% / 9.2%, FlashAttention-2 6.9% / 10.5% with ``ring``;
``bulk`` 12.5-13.9% / 15.5-16.8%, ``none`` 15.0-16.5% / 17.9-19.1%), then the kernel was read in Transformer
Engine's source at the pinned commit (above) and the vocabulary in the benchmark's reference (FlashAttention-2
10.5% -> 10.4% max). On all eight rows, blocking sends: cuDNN 5.5% / 9.2%, ``bulk`` 13.9% / 16.8%, ``none`` 16.5% /
19.1%; with --overlap-p2p (below): cuDNN 4.5% / 9.2%, ``bulk`` 8.1% / 16.8%, ``none`` 10.7% / 19.1%. Alternatives,
not the source's (blocking sends): V 6 5.35% / 10.3%; the parameter all-gather not overlapped 8.5% / 13.2%.
With the sends as the source runs them (--overlap-p2p, built for this table after reading schedules.py at
df727128): -2.7% (512, 768 GPUs, m = 128), +0.7% to +1.2% (m = 16), and the m = 8 rows unchanged (+10.4%, +10.0%,
Azure +8.2%): median 2.7%, max 10.4%. At m = 8 = p every chunk forward is warm-up, there is no steady state for
the overlap to hide sends in, and the planner keeps its blocking count 2 (m + p - 1) v = 360 sends, an upper bound:
the event-by-event schedule puts 204 on the critical path at m = p (2 (p v - 1) + 2 (p - 1);
tests/plan/test_megatron_schedule.py): the 156 sends charged beyond those, 0.267 ms each, are 42 ms of the rows'
0.93 s, about 4.5 of their 8-10 points. Kept: the same bound is what the planner charges every blocking pipeline
(MegaScale's Table 3 prices a blocking call above its transfer), and changing it moves every pipeline table.

Where the rest sits (test_time_a_microbatch_and_a_step): over the m = 128 and m = 16 rows (512 and 4,096 GPUs, the
same stage work) the table's time a micro-batch is 84.3 ms and the planner's 81.5 ms (-3.3%); the time a step that
does not scale with micro-batches (bubble, the fill and drain's sends, the first parameter all-gather and last
gradient reduce-scatter that the overlap cannot hide, the optimizer step) is 0.26 s in the table and 0.32 s in the
planner.
"""

from statistics import median

import pytest

from tandem.plan.cost import check, evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

GPT3_175B = GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=50688, dropout=False)   # custom.yaml: 0.0
# submitter, GPUs, global batch, gradient accumulation (micro-batches a step), step time (s): the logs' medians
ROWS = [("nvidia", 512, 2048, 128, 11.0539), ("nvidia", 768, 3072, 128, 11.0754), ("nvidia", 4096, 2048, 16, 1.6084),
        ("nvidia", 6144, 3072, 16, 1.6152), ("nvidia", 8192, 4096, 16, 1.6192), ("nvidia", 10240, 2560, 8, 0.9256),
        ("nvidia", 10752, 2688, 8, 0.9296), ("azure", 10752, 2688, 8, 0.9451)]
TP, PP, V = 4, 8, 12


def _plan(gpus, gbs, kernel="fa2", tp_overlap="ring", overlap_p2p=True):
    m = gpt_stats(GPT3_175B, "gpt3-175b")
    c = make_cluster("h100-sxm", 8, gpus // 8, inter="ib-ndr", nics_per_node=8)
    s = Strategy(dp=gpus // (TP * PP), tp=TP, pp=PP, zero=1, micro_batch=1, schedule="interleaved", virtual=V,
                 ranks_per_node=8)
    t = Training(global_batch=gbs, precision="fp8", optimizer="adam", overlap_param_gather=True,
                 attention_kernel=kernel, tp_overlap=tp_overlap, grad_reduce="bf16", overlap_p2p=overlap_p2p)
    assert check(m, c, t, s) is None
    return evaluate(m, c, t, s)


def errors(**kw) -> dict[str, float]:
    return {f"{who}-{gpus}": _plan(gpus, gbs, **kw).step_s / step - 1 for who, gpus, gbs, _, step in ROWS}


def test_step_time_within_the_issue_tolerance():
    errs = {k: abs(e) for k, e in errors().items()}
    assert median(errs.values()) <= 0.10, errs
    assert max(errs.values()) <= 0.25, errs
    # pinned just above today's 2.7% / 10.4%: a change that worsens them fails
    assert median(errs.values()) <= 0.03 and max(errs.values()) <= 0.11, errs


def test_async_sends_are_what_the_submission_runs():
    """--overlap-p2p (overlap_p2p_comm True) moves the rows with a steady state (m = 128, 16) by the sends it hides
    and leaves the m = 8 = p rows as they are; charged as blocking, the table still passes (7.0% / 10.4%)."""
    on, off = errors(), errors(overlap_p2p=False)
    for who, gpus, _, accum, _ in ROWS:
        k = f"{who}-{gpus}"
        assert (on[k] < off[k] - 0.005) if accum > PP else on[k] == off[k], (k, on[k], off[k])
    assert median(abs(e) for e in off.values()) <= 0.10 and max(abs(e) for e in off.values()) <= 0.25


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_the_plan_is_the_logged_layout_and_fits(row):
    _, gpus, gbs, accum, _ = row
    p = _plan(gpus, gbs)
    assert p.strategy.world == gpus and p.grad_accum == accum   # the log's gradient_accumulation_steps
    assert p.memory.fits, p.memory.total / 2**30                 # it ran: it fits in 80 GB


def test_time_a_microbatch_and_a_step():
    """The same stage work at m = 128 and m = 16 (512 and 4,096 GPUs): the slope is the time a micro-batch, the rest
    the time a step that does not scale with micro-batches (module docstring)."""
    table = {g: s for _, g, _, _, s in ROWS}
    plan = {g: _plan(g, b).step_s for _, g, b, _, _ in (ROWS[0], ROWS[2])}
    a_t, a_p = (table[512] - table[4096]) / 112, (plan[512] - plan[4096]) / 112
    assert a_p == pytest.approx(a_t, rel=0.04)
    b_t, b_p = table[4096] - 16 * a_t, plan[4096] - 16 * a_p
    assert 0.2 < b_t < b_p < 0.4


def test_the_userbuffers_overlap_moves_every_row():
    """With the tensor-parallel collectives exposed (``none``: 10.7% / 19.1%, every row slow) or only the dgrad
    reduce-scatter hidden (``bulk``: 8.1% / 16.8%) every row is slower than with the ring-exchange and pipelined
    overlaps the submission configures (TP_COMM_OVERLAP True), by 5 points or more."""
    ring, bulk, none = errors(), errors(tp_overlap="bulk"), errors(tp_overlap="none")
    for k in ring:
        assert none[k] > bulk[k] > ring[k] + 0.05, (k, none[k], bulk[k], ring[k])
