"""TFLOPS per GPU against Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (VLDB
2023, arXiv:2304.11277), Section 5.4, the numbers its text states (the plots of Figures 6-8 are not read). The
text was read from a transcription of the paper in the stored corpus (find_string "near-linear scalability in terms
of TFLOPS"; Section 5.1 and 5.4).

Setup (Section 5.1, 5.4): A100 80GB, "interconnected by a 2Tb/s RoCE network" (8 GPUs and 8 x 200 Gb/s a node
assumed), FULL_SHARD with backward prefetch and the rate limiter, activation checkpointing, BF16 mixed precision,
Adam; minGPT 175B, vocabulary 50000, block size 2048, batch 1 and 2 per GPU on 128 to 512 GPUs. The shape is not
given beyond "175B": GPT-3's (96 layers, hidden 12288, 96 heads; minGPT's untied output layer: 175.2B).
- "the experiments achieved more than 173 and 186 TFLOPS per GPU with batch size equal to 1 and 2 respectively
  ... approximately 55% and 60% of GPU hardware utilization": compared with the planner's hardware FLOPs
  (recompute included: "hardware utilization") per GPU per second, at 512 GPUs.
- "linear scalability from 128 GPUs to 512 GPUs, in terms of TFLOPS": the planner's TFLOPS per GPU must not move
  by more than 5% over that range (the paper's one exception, 128 GPUs at batch 2, it explains by allocator
  defragmentation, which is not modelled: left out).
Not checked: T5-11B (Figure 7 (c); the text gives only a 7% per-GPU regression from 8 to 512 GPUs, and the planner
describes decoder-only shapes, not T5's encoder-decoder), DHEN (a recommendation model), the rate-limiter and
prefetch speedups (the planner has neither knob: it assumes prefetch).

Errors, measured after the per-architecture compute model (efficiency.py: the A100's linear layers at 0.67 of
peak, from the FlashAttention-2 paper's runs; nothing fitted to this paper): median 6.7%, max 10.3%, within issue
14's tolerance (before it, with one default efficiency, 14.2% / 17.1%, both slow). FSDP's communication is not
what sets the step: under 1% of it is exposed (prefetch hides the all-gathers behind the previous block).
KNOWN MISS since the memory-bound ops were charged apart (bandwidth_bound.py: minGPT's eager LayerNorm, GeLU, adds and
loss, 1-2% of this step) and the A100 linear share re-derived without them from the same FlashAttention-2 runs
(0.67 -> 0.71): median 11.1%, max 14.8% (batch 1 +14.8%, batch 2 +7.4%, both FAST). minGPT's dropout (0.1 on the
residuals and embeddings, separate eager kernels) is not modelled (bandwidth_bound.py takes dropout as off).
With A100 unfused attention at its measured 0.156 of peak (was 0.163): median 10.5%, max 14.2% (batch 1 +14.2%,
batch 2 +6.8%), pinned at 11% / 15%.
PASSES since FSDP1's own copies are timed (fsdp_copies.py, fsdp="fsdp1": the paper's FullyShardedDataParallel;
read in torch's source): backward concatenates the flat parameter's split views' gradients into the flat gradient,
4 B per unsharded parameter per micro-batch on the compute stream, 175.2B x 4 B / (0.9 x 2.039 TB/s) = 382 ms a
micro-batch, a fixed cost per micro-batch that weighs twice as much at batch 1 (the paper's batch 1 runs 7% below
batch 2 per FLOP); the in-place pre-divide (factor 32 at 512 GPUs) before each reduce-scatter, 3.95 ms a block,
hides with it. Measured: median 8.4%, max 11.3% (batch 1 +11.3%, batch 2 +5.4%, both still fast: minGPT's
dropout remains unmodelled). Communication exposed: 0.99% of the batch-1 step (asserted under 1%).
Checked against the paper's other statement: with backward prefetch off (FSDP1 then gathers block i only after
block i+1's reduce-scatter, both serial with compute) the planner's blocks give 22% at batch 2 and 44% at batch
1 against the "approximately 18% speedup" of Section 5.2 (Figure 6 (b), batch not stated): communication is not
too fast here, so a slower network is no explanation for the fast rows.
"""

from statistics import median

from tandem.plan.cost import evaluate, validate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

GPT_175B = dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=50000, tied=False)
# Section 5.4: batch size per GPU -> TFLOPS per GPU ("more than"), at 128-512 GPUs
ROWS = {1: 173, 2: 186}
GPUS = 512


def _plan(batch: int, gpus: int = GPUS):
    m = gpt_stats(GPTShape(**GPT_175B), "mingpt-175b")
    c = make_cluster("a100-80gb", 8, gpus // 8, inter="roce-200", nics_per_node=8)
    t = Training(global_batch=batch * gpus, precision="bf16", optimizer="adam", kernels="eager",
                 fsdp="fsdp1")
    s = Strategy(dp=gpus, zero=3, micro_batch=batch, recompute="full", ranks_per_node=8)
    validate(m, c, t, s)
    return evaluate(m, c, t, s)


def hw_tflops(batch: int, gpus: int = GPUS) -> float:
    p = _plan(batch, gpus)
    return p.hw_flops_per_gpu / p.step_s / 1e12


def errors() -> dict[str, float]:
    return {f"GPT-175B batch {b} {GPUS} GPUs": hw_tflops(b) / tf - 1 for b, tf in ROWS.items()}


def SCOREBOARD() -> dict[str, dict[str, float]]:
    return {"fsdp paper 175B": errors()}


def test_tflops_per_gpu_within_the_issue_tolerance():
    errs = {k: abs(e) for k, e in errors().items()}
    assert median(errs.values()) <= 0.10 and max(errs.values()) <= 0.25, errs   # issue 14: 10% median, 25% max


def test_fsdp1_copies_are_what_moved_it():
    """4 B per unsharded parameter a micro-batch at 0.9 of the A100's bandwidth; without it batch 1 is +14%."""
    p = _plan(1)
    assert abs(p.fsdp_copy_s - 175.2e9 * 4 / (0.9 * 2.039e12)) < 0.01 * p.fsdp_copy_s, p.fsdp_copy_s
    assert hw_tflops(1) * p.step_s / (p.step_s - p.fsdp_copy_s) > ROWS[1] * 1.12, p.fsdp_copy_s


def test_it_fits_and_the_miss_is_not_communication():
    for b in ROWS:
        p = _plan(b)
        assert p.memory.fits, (b, p.memory.total / 2**30)
        assert p.exposed_comm_s < 0.01 * p.step_s, (b, p.exposed_comm_s, p.step_s)


def test_tflops_per_gpu_scale_linearly_from_128_to_512_gpus():
    for b, lo in ((1, 128), (2, 256)):   # 128 GPUs at batch 2: the paper's defragmentation outlier
        assert abs(hw_tflops(b, lo) / hw_tflops(b) - 1) <= 0.05, b
