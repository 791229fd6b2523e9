"""Throughput against a third publication, FSDP (ZeRO-3) only: MosaicML llm-foundry's MPT training benchmarks
(mosaicml/llm-foundry, scripts/train/benchmarking/README.md, commit 061f2c7c: tables "A100 80GB with 1600 Gbps
node-node interconnect (RoCE)", "H100 80GB BF16" and "H100 80GB FP8"; each row below is one printed row, its
Throughput (T/s/GPU) column as the expected number). 8 to 64 GPUs, 125M to 70B parameters.

The planner gets each row's MPT shape (d_model, n_layers, n_heads of the yamls; vocab 50368, learned positions,
biases, tied embeddings: its parameter count then equals the table's NumParams column exactly), sequence, GPUs,
micro-batch and global batch, FULL_SHARD as --zero 3 on every GPU, activation checkpointing True as full
recompute, an attention kernel (below), AdamW, bf16 or fp8, and its default efficiency: nothing fitted.
Attention kernel: the tables were made by submit_benchmarks.py as merged with them (b2a43a14, Oct 2023): llm-foundry
v0.3.0 installed with its "gpu" extra (flash-attn 1.0.9 and triton-pre-mlir; the H100 FP8 runs add
`pip install flash-attn==1.0.7` and TransformerEngine v0.10, with fc_type "te": te.Linear for every linear
layer), attn_impl = its --attn_impl default "triton" (the yamls say "triton" too; the default stayed until March
2024): flash-attn 1.x's Triton FlashAttention (llmfoundry/models/layers/flash_attn_triton.py), a
first-generation kernel, "slightly slower than CUDA [FlashAttention-1] forward + backward" by its own header.
The planner times it as attention_kernels.py does (--attention-kernel triton: FlashAttention-2's speed x FlashAttention /
FlashAttention-2 in the FlashAttention-2 paper's H100 figure x Triton / FlashAttention in its A100 figure;
0.40-0.55 of FlashAttention-2 at head dim 128, 512-8k tokens). All three tables are planned with it (the lead's
merge: the A100 and H100 BF16 tables would pass with FlashAttention-2, but the source says they did not run it,
and a kernel chosen per table to pass would be a fit). With "triton" the BF16 tables miss the tolerance (A100 10.3% / 30.1%, H100 BF16 10.8% / 23.2%, every miss slow:
the attention-heavy rows: A100 7B s8192 -30%, 13B s4096 -24%; H100 7B s4096 -23%, 30B -22%), pinned by the known-miss test below; a term of the 2023
BF16 stack that the FA2 assumption was standing in for is not found (see KNOWN MISSES).
Network: 8 NICs a node; A100 as the table says (1600 Gb/s RoCE: 8 x roce-200), H100 unstated (8 x NDR 400 assumed).

KNOWN MISSES (issue 14 asks 10% median, 25% max). On main when written: A100 19.4% / 34.5% (all slow), H100 BF16
18.9% / 43.5% (small models fast), H100 FP8 63% / 162% (all fast). With the per-architecture compute model
(efficiency.py: A100 linear layers at 0.67 of peak from the FlashAttention-2 paper's end-to-end runs, H100 at 0.50
from Databricks' and Megatron-LM's published MFU; gemm.py: measured GEMM speeds by shape; FP8 at 0.942 of BF16's
share with its casts timed; nothing fitted to this table):
- A100 80GB: median 6.7%, max 26.4% (125M +26%, 13B s4096 with recompute -15%): the median meets the issue's
  tolerance, the max does not: the 125M model (d_model 768) still runs slower than its GEMM shapes say (its
  LayerNorm/GeLU/optimizer time, memory-bound and not modelled, is a large share at that size).
- H100 BF16: median 14.4%, max 34.0%: 760M-13B still predicted FAST (+14..+34%), 30B/70B with recompute slow
  (-12, -15%): MPT's 2023 stack (eager PyTorch, FlashAttention-2 at 35% of H100 peak) sustains less than the 0.50
  the 2024 sources publish, the more so the smaller the model. Term: per-framework efficiency and the
  memory-bound non-GEMM time of small models on H100 (not modelled).
- H100 FP8 (FlashAttention-2 assumed until the kernel above was found): median 34.2%, max 65.7%, all FAST (+25..+66%): these 350M-3B rows (Transformer Engine of 2023)
  ran at 15-30% of the FP8 peak, below their own BF16 rows' MFU; the planner's FP8 (0.942 x the BF16 share, smaller
  K penalised as measured, casts at 4 B an element) still gains 1.3-1.5x over BF16 at these sizes. Term: FP8
  overheads of early Transformer Engine at small shapes.
With the memory-bound ops charged (bandwidth_bound.py; MPT's 2023 stack is eager PyTorch 1.13 without
torch.compile, "TODO: Update tables with torch 2.0" in the README, with its low-precision LayerNorm kernel, GeLU,
FlashAttention and flash-attn's fused cross-entropy, llm-foundry's default loss_fn: --kernels eager with a fused
loss; composer's DecoupledAdamW step as PyTorch's foreach passes) and the A100 / H100 linear shares re-derived
without them from their sources (0.71, 0.508):
- A100 80GB: median 4.9%, max 19.5% (125M +19.5%, 13B s4096 -12.6%): WITHIN the issue's tolerance (test below).
- H100 BF16: median 10.8%, max 22.9% (760M +22.9%, 13B +13..+19%, 30B -16%): the max now meets the tolerance, the
  median misses it by 0.8 points.
- H100 FP8: median 25.0%, max 38.3% (all fast): the early Transformer Engine FP8 overheads above remain.
With the attention-kernel model (efficiency.py: each kernel's published share of peak by sequence length, a
causal kernel computing half the counted square; FlashAttention-2 here): A100 median 9.4%, max 31.8% (all rows
faster: FlashAttention-2 at its own 0.615 of A100 peak where it ran at 0.515; 125M +32%); H100 BF16 14.8% / 32.6%;
H100 FP8 36.5% / 54.6% (the s512 rows slower, the s8192 faster). The A100 table's max and median grow: the miss is
the same small-model term as above (non-GEMM time of a 768-wide model), now larger as attention got faster.
The bounds below pin today's errors so that a change that makes them worse fails; tighten them as the
efficiency model improves (the issue's tolerance is the goal).

With both the memory-bound ops (eager, fused loss) and the attention-kernel model (FlashAttention-2), as merged:
A100 median 6.4%, max 22.6% (125M +22.6%) and H100 BF16 9.9% / 21.4% (760M +21.4%) both WITHIN the issue's
tolerance (tests below); H100 FP8 23.8% / 43.4%, all fast: KNOWN MISS, pinned at 24% / 44% (early Transformer
Engine FP8 at 350M-3B, and the s8192 rows' attention).
With FSDP1's own copies timed (fsdp_copies.py, fsdp="fsdp1": Composer wraps MPT in FullyShardedDataParallel;
backward concatenates each flat parameter's views' gradients, 4 B per unsharded parameter per micro-batch, and
pre-divides before each reduce-scatter): A100 7.0% / 22.5%, H100 BF16 9.4% / 21.2% (both still within the
tolerance), H100 FP8 23.2% / 42.6%.
With the attention kernel the runs used (attention_kernels.py, "triton", above) for the H100 FP8 table: 7.8% / 23.9%
(3b s8192 -13.0%, 1b s8192 -9.6%, 3b s2048 -5.9%, 1b s512 -2.1%, 3b s512 +1.7%, 350m s512 +23.9%): WITHIN the
issue's tolerance (test below); before, 1b/3b s8192 were +43% / +34% fast: their attention (38% / 33% of the
model FLOPs) at FlashAttention-2's speed, 2.3x what Triton FlashAttention runs at 8k on H100. The 350m row stays
fast (head dim 64, d_model 1024: attention is only 16% of its time): Transformer Engine v0.10's fixed costs per
module and micro-batch (te.Linear without is_first_microbatch casts and transposes its weights every micro-batch,
module/linear.py `update_fp8_weights = is_first_microbatch is None or ...`: 4 B x 0.30B linear weights = 1.2 GB, 0.4 ms
a micro-batch, 0.2% of this row; amax/scale updates per module) are not priced: no source gives their time.
FlashAttention-1 ("fa1", the CUDA kernel) instead: 6.8% / 23.6%.

INPUT AUDIT (session 9, after torchtitan's pipeline rows proved a wrong input): every input of the A100 80GB and
H100 BF16 rows checked against the run's own sources, nothing found to change, errors as above. Per row, the README
at 061f2c7c (= b2a43a14's numbers) gives MicroBatchSize, GradAccum, GlobalBatchSize, Activation Checkpointing,
Activation CPUOffload False, FULL_SHARD and NumParams as planned here (each test row checked column by column). The
MFU column is (6 x NumParams + 12 x n_layers x d_model x seq) x T/s/GPU / peak (312 / 989.4 TFLOPS) to 0.1 point
on every row, and the planner's FLOPs per token are 0.990-0.9996 of that count (it omits the position embedding's
and biases' share): the FLOP count is not the miss. How the rows ran: the H100 and the re-measured A100 rows
(commit 4b482bd6, Oct 2023) were made on mosaicml/pytorch:2.1.0_cu121-nightly20230827 (the "Image" column of the
run list h100new.csv, deleted in 803e6718), where submit_benchmarks.py installs torch 2.1.0.dev20230821 and Composer
at 784f50be; llm-foundry installed from crinard/llm-foundry@add_attns with its "gpu" extra (that branch's
attention.py, as committed here before 803e6718 reverted it, adds xformers but still maps "triton" to
triton_flash_attn_fn); attn_impl "triton" (the
flag's default, sweep.sh never sets it) and triton-pre-mlir (sm90 branch) in llm-foundry's base requirements, so the
Triton kernel ran: a missing install raises, it does not fall back to torch attention, and the kernel supports head
dims up to 128 (every model here but 125m/350m, whose head dim is 64) with a faster d=128 backward
(flash_attn_triton.py header). norm_type low_precision_layernorm (set by the script), loss_fn fused_crossentropy
(MPT's default, xentropy-cuda-lib in the gpu extra), no torch.compile (compile_config None), biases and learned
positions (the NumParams match). FSDP: mixed_precision DEFAULT (the table column; the script's --fsdp_config_
mixed_precision default PURE is never passed on), which at Composer 784f50be sets param_dtype and buffer_dtype to
bf16 and leaves reduce_dtype None, so torch FSDP reduces in param_dtype, bf16 (Composer's "patch default", d745fcb1,
made DEFAULT reduce in fp32 on 2023-10-10, after these runs): the planner's bf16 reduction is right (--grad-reduce
fp32 would be the wrong input); limit_all_gathers true and activation_checkpointing_reentrant false (the yamls),
activation_cpu_offload false, forward_prefetch False and backward_prefetch BACKWARD_POST (Composer's defaults; the
planner's prefetch rule does not tell PRE from POST: on one node's NVLink the gathers are a few % of a step).
The A100 70b row is an older run kept by commit 722c6c43 ("added back old numbers that I didn't reproduce"; in the
README since May 2023, 1ef7b4d2, the torch 1.13 tables): its
Precision "bf16" and MP Mode PURE: bf16 parameters and reduction, as planned. The GPU count per row is the table's;
the A100 network is the table's title (1600 Gb/s RoCE, 8 x roce-200), the H100 one unstated (8 x NDR assumed; the
64-GPU and 32-GPU H100 rows cross nodes, the rest are one node). What is left is the kernel's speed, not an
input: the A100 7b s8192 row's published
MFU is 54.5% (HFU 72.6%) with its Triton attention (24% of its model FLOPs) and full recompute: with the linear
layers at the planner's 0.71 of peak, the causal attention must have run at 0.39 of peak or faster (1/0.5447 -
0.757 x 4/3 / 0.71 = 0.415 peak-units left for 0.243 x 4/3 / 2 = 0.162 of attention work, and nothing else),
where attention_kernels.py takes the FlashAttention-2 paper's A100 "Triton" bar (Fig. 4, head dim 128, causal, 8k: 78
TFLOPS, 0.25 of peak); whether that bar is the triton-pre-mlir kernel MPT ran is not stated in the paper. That
factor, not an input, is the first candidate for the slow attention-heavy rows (not changed here: no source)."""

from statistics import median

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

# MPT yamls (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml; 760m and 30b read at commit 39393a21):
# n_layers, d_model, n_heads
MPT = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
       "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56),
       "70b": (80, 8192, 64)}
# model, SeqLen, # GPUs, MicroBatchSize, GlobalBatchSize, Activation Checkpointing, T/s/GPU, NumParams
A100_80GB = [
    ("70b", 2048, 64, 8, 2048, True, 410, 64862437376), ("30b", 2048, 8, 3, 504, True, 916, 29975214080),
    ("30b", 4096, 8, 1, 168, True, 814, 29989894144), ("13b", 2048, 8, 2, 48, False, 2262, 12853954560),
    ("13b", 4096, 8, 10, 240, True, 2060, 12864440320), ("7b", 2048, 8, 6, 96, False, 4641, 6658859008),
    ("7b", 8192, 8, 8, 128, True, 3206, 6684024832), ("3b", 2048, 8, 10, 160, False, 10811, 2651837440),
    ("3b", 8192, 8, 3, 144, False, 7695, 2667566080), ("1b", 2048, 8, 14, 448, False, 20513, 1315950592),
    ("760m", 2048, 8, 24, 384, False, 32434, 760470528), ("350m", 2048, 8, 32, 512, False, 58782, 355985408),
    ("125m", 2048, 8, 32, 512, False, 141737, 125311488),
]
H100_BF16 = [
    ("70b", 2048, 64, 8, 2048, True, 1039, 64862437376), ("30b", 2048, 32, 14, 1344, True, 2308, 29975214080),
    ("30b", 2048, 8, 3, 504, True, 2002, 29975214080), ("13b", 2048, 64, 2, 128, False, 4800, 12853954560),
    ("13b", 2048, 8, 2, 16, False, 4792, 12853954560), ("7b", 2048, 8, 6, 48, False, 10643, 6658859008),
    ("7b", 4096, 8, 16, 256, True, 8611, 6667247616), ("3b", 2048, 64, 6, 1152, False, 22525, 2651837440),
    ("3b", 4096, 8, 5, 240, False, 20964, 2657080320), ("1b", 2048, 64, 20, 1280, False, 44402, 1315950592),
    ("1b", 2048, 8, 14, 112, False, 45455, 1315950592), ("760m", 2048, 8, 24, 384, False, 63147, 760470528),
]
H100_FP8 = [
    ("3b", 8192, 8, 3, 144, False, 19146, 2667566080), ("3b", 2048, 8, 10, 480, False, 30586, 2651837440),
    ("3b", 512, 8, 40, 1920, False, 36527, 2647905280), ("1b", 8192, 8, 2, 64, False, 32010, 1328533504),
    ("1b", 512, 8, 56, 1792, False, 70315, 1312804864), ("350m", 512, 8, 56, 1792, False, 154420, 354412544),
]
# table: rows, GPU, network, precision, attention kernel (see KNOWN MISSES: all three ran attn_impl triton)
TABLES = {"a100-80gb": (A100_80GB, "a100-80gb", "roce-200", "bf16", "triton"),
          "h100-bf16": (H100_BF16, "h100-sxm", "ib-ndr", "bf16", "triton"),
          "h100-fp8": (H100_FP8, "h100-sxm", "ib-ndr", "fp8", "triton")}
# (median, max) relative error pinned for the tables that miss the issue's tolerance at the kernel they ran
# (triton): see KNOWN MISSES above (with FlashAttention-2 assumed they would pass: an assumption the source
# contradicts, so it is not what they are planned with)
KNOWN_MISS_AS_RUN = {"a100-80gb": (0.11, 0.31), "h100-bf16": (0.11, 0.24)}


def _model(name, seq):
    layers, hidden, heads = MPT[name]
    return gpt_stats(GPTShape(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=50368), f"mpt-{name}")


def _tokens_per_gpu(row, gpu, inter, precision, kernel="fa2"):
    name, seq, gpus, mbs, gbs, ckpt, _, _ = row
    m = _model(name, seq)
    c = make_cluster(gpu, 8, gpus // 8, inter=inter, nics_per_node=8)
    t = Training(global_batch=gbs, precision=precision, optimizer="adamw", attention_kernel=kernel, kernels="eager",
                 fused_loss=True, fsdp="fsdp1")
    s = Strategy(dp=gpus, zero=3, micro_batch=mbs, recompute="full" if ckpt else "none", ranks_per_node=8)
    p = evaluate(m, c, t, s)
    assert p.memory.fits, (row, p.memory.total / 2**30)   # every row ran, so it must fit
    return gbs * seq / p.step_s / gpus


def errors(table: str, kernel: str | None = None) -> dict[str, float]:
    rows, gpu, inter, precision, k = TABLES[table]
    return {f"{r[0]}-s{r[1]}-g{r[2]}": _tokens_per_gpu(r, gpu, inter, precision, kernel or k) / r[6] - 1
            for r in rows}


def test_parameter_counts_equal_the_tables_numparams():
    for rows, *_ in TABLES.values():
        for r in rows:
            assert _model(r[0], r[1]).params == r[7], r


@pytest.mark.parametrize("table", ["h100-fp8"])
def test_tokens_per_gpu_within_the_issue_tolerance(table):
    errs = {k: abs(e) for k, e in errors(table).items()}
    assert median(errs.values()) <= 0.10 and max(errs.values()) <= 0.25, errs


@pytest.mark.parametrize("table", list(KNOWN_MISS_AS_RUN))
def test_bf16_tables_at_the_kernel_they_ran_known_miss(table):
    errs = {k: abs(e) for k, e in errors(table).items()}
    med_bound, max_bound = KNOWN_MISS_AS_RUN[table]
    assert median(errs.values()) <= med_bound, errs
    assert max(errs.values()) <= max_bound, errs
