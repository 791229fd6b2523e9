"""Throughput against a fourth publication, PyTorch-native FSDP2 with TP, PP, CP and Float8: torchtitan's
performance report (pytorch/torchtitan, docs/performance.md; the same tables as Liang et al., "TorchTitan",
arXiv:2410.06511). Two versions of the file, each row's TPS/GPU (WPS) as the expected number:
- commit eaea6f6a, Tables 1-6: Llama 3.1 8B / 70B / 405B on 8 to 512 H100s (Grand Teton: 8 GPUs a host on
  NVLink, 400 Gb/s RDMA per GPU, 96 GB HBM2e, 500 W power limit), FSDP, FSDP + TP, FSDP + TP + PP, CP, Float8
  (on nn.Linear only), selective or full activation checkpointing, sequence 8192 unless the row says.
- commit 04133643, "Llama 3 / Llama 2 performance numbers": 64 A100-80GB, FSDP2 only (interconnect unstated:
  8 x HDR 200 assumed), Llama 3 8B/70B (the 3.1 shapes) at sequence 8192, Llama 2 at 4096.

The planner gets each row's shape, degrees (FSDP as --zero 3 over dp; TP/PP/CP as given), local batch (one
micro-batch per FSDP rank where there is no pipeline; with one, the local batch split into pp micro-batches,
torchtitan's default: see *Micro-batches under PP* below), recompute
(selective / full / none), bf16 or fp8, Flash attention (SDPA), AdamW and its default efficiency: nothing
fitted. torch.compile rows are used only where the row is also Float8 (the table has no Float8 row without
compile); the planner has no compile term.
Table 5's interleaved row: torchtitan's default for a multi-stage schedule, 2 stages a rank, split by its
generate_split_points (126 layers in 16 chunks: 7, 8 x 14, 7; chunk j on rank j mod 8), torch's
ScheduleInterleaved1F1B over 32 micro-batches. The CP rows run torch's context_parallel (`cp_impl="torch"`:
all-gather K/V rotation, fp32 dK/dV ring and merges, SDPA's FlashAttention-2 kernel; tandem/plan/terms/context.py).
Memory column: the tests at the end (issue 29); Table 6's CP 4 and CP 8 rows (131k, 262k tokens; left out
when the file was written: +28.9% and +44.8% then, +36.9% and +60.9% on bf33351, +31.0% and +49.2% with the ring's
diagonal block, last dK/dV send and repeated K/V).

KNOWN MISSES (issue 14 asks 10% median, 25% max). On main when written: H100 26.1% / 55.8% (all fast), A100 21.3% /
26.6% (all slow). With the per-architecture compute model (efficiency.py, gemm.py; nothing fitted to this table)
and the H100 rows on the h100-sxm-500w preset (the report's 500 W, HBM2e 2.4 TB/s Grand Teton H100s, peak between
the SXM's and the NVL's as its footnote says: their midpoint):
- H100 (12 rows): median 8.6%, max 34.3%: the median meets the tolerance; the long-context CP rows (131k +30%,
  262k +34%, 405B CP 2 +19%) and the 405B 1F1B row (+34%) are still FAST. Terms at fault: attention at long
  sequence under ring CP (the CP cost model) and the pipeline schedule of Table 5, not the linear layers (the 8B
  and 70B rows without CP are within 11%).
- A100 (6 rows): median 6.0%, max 18.0%: within the tolerance (test below).
With the reduce-scatter in FP32, torchtitan's default (mixed_precision_reduce = "float32"): H100 8.4% / 34.0%,
A100 5.9% / 17.7% (FSDP hides most of it).
- Memory: the 8B selective-AC rows come out 97.7 GiB (8 GPUs) and 83.7 GiB (128) against 82.4 and 67.0 GiB
  published, and Llama 2 70B selective at local batch 1 109.5 GiB where it ran in 80 GB: torchtitan's
  "selective op" checkpointing keeps less than the planner's selective (which drops only the attention
  scores). Term: selective recompute's memory (issue item 5). Not asserted here.
Attention kernel: torch SDPA, which picks the first usable backend in its priority order
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, priority_order): PyTorch 2.5.0 put cuDNN first on H100,
later versions put flash (FlashAttention-2) first again and cuDNN last; the report ran torch nightlies after
2.5 (torchtitan follows nightly), and under CP torchtitan allows only flash/efficient (context.py). So every row:
attention_kernel "fa2". With the attention-kernel model (efficiency.py: FlashAttention-2 at the FlashAttention-3
paper's measured H100 speed, ~35% of peak; a causal kernel computing half the counted square; the ring's blocks at
the non-causal speed): H100 median 20.0%, max 65.6%, every row FAST: 8B FSDP +17%, the CP rows +20% (CP 2) to
+66% (262k tokens, CP 8), 405B 1F1B +36%. A100 5.8% / 21.8%, still within the tolerance. KNOWN MISS re-pinned just
above; terms at fault: the memory-bound non-GEMM time (norms, activations, RoPE, the fp32 loss; not modelled
here) that a cheaper attention now exposes, and at long context ring attention's per-block kernel time (the
diagonal block's mask and the ring's load imbalance, not modelled).

With the memory-bound ops, the attention-kernel model (FlashAttention-2 through SDPA) and FP32 gradient
reduction, as merged: H100 median 8.4%, max 64.2%: every row without long-context CP within 17% (1F1B +8.4%,
interleaved -10.8%), the CP rows fast (CP 4 +56.9%, CP 8 +64.2%, 405B CP 2 +33.5%): KNOWN MISS on the max, pinned
at 9% / 65%. Term at fault: ring attention's per-block kernel time at long context (the diagonal block's mask,
the ring's load imbalance, torch's merge kernels), which Llama 3's CP 16 row shows too. A100: 5.6% / 21.6%, within.

With the ring as the sources run it (context.py; checked against torch's _templated_ring_attention at the report's torch
commit 1963fc8 and torchtitan 9dec370): the diagonal step's causal block (1/cp of the FLOPs at FlashAttention-2's
causal speed on s/cp tokens), torch's last dK/dV send waited for after the backward loop (exposed), and K/V
repeated to the 32 query heads before SDPA (torchtitan's Llama calls repeat_kv: the ring moves and merges 4x the
GQA bytes; kv_repeat=True): H100 median 8.4%, max 59.1%: CP 2 +10.7% (was +16.8%), CP 4 +50.8% (+56.9%), CP 8
+59.1% (+64.2%), 405B CP 2 +26.9% (+33.5%). KNOWN MISS re-pinned at 9% / 60%. What is still at fault is not the
ring's per-block kernel time: Table 2 keeps 32,768 tokens a GPU in every row, so every ring step's block has the
same shape at CP 2, 4 and 8 (a 32k x 16k or 16k x 32k rectangle, the causal 32k diagonal); the measured time per
token grows 2.37x from CP 2 to CP 4 for 2x the attention FLOPs (1.78x predicted) and 1.95x from CP 4 to CP 8: a
cost that grows faster than the ring's steps at a fixed block, which no source read here (torch's ring, torchtitan's
train loop, its TPS accounting: labels.numel() / (time x cp x tp x pp), as the test computes) accounts for.

Checked in session 8, nothing adopted (pins unchanged; docs/plan.md, *Ring attention*): read as attention time, the
table's steps give 1.27x the FlashAttention-2 figure at CP 1 and 1.15x / 1.62x / 1.68x at CP 2 / 4 / 8 (the 405B
rows, CP across nodes: 1.16x at CP 1, 1.59x / 1.51x / 1.70x at CP 2 / 4 / 8, the last two not in this table). Not
the cause: load balancing (on by default: torch 2.6.0's enable_load_balance = True with head-tail chunks; off, the
last rank's work would be 1.5x at CP 2, which the CP 2 row rules out), the ring's per-step waits (one K/V
all-gather a layer forward; backward dK/dV sends between ranks of equal work per step, a few ms on NVLink against
~70 ms of a block's backward), a FLOP formula (the table is tokens a second; torchtitan's MFU counts the full
square, as the planner), the SDPA backend (flash on every block: torchtitan allows flash/efficient under CP,
torch 2.6's ring maps only those). Open: why rings of 4+ steps, or across nodes, run their blocks ~1.6x slower.

With the pipeline's fill and drain repeating each micro-batch's TP and ring communication (pipeline.py):
H100 median 7.0%, max 59.1% (405B 1F1B +6.5%, interleaved -11.6%, CP 2 +20.2%) when merged; A100 unchanged (no
pipeline). Re-measured on today's main, with the rows planned with pp_grad_sync "step" (below): H100 median 10.2%,
max 58.9% (CP 8); A100 4.3% / 15.2%.

Async TP: Tables 5 and 6 ran it ("+ AsyncTP" in their captions), Table 4's "2D" row did not. The T5/T6 rows are
planned with it (--tp-overlap ring, the lead's merge: every table is planned as its source says it ran, and these
rows were first kept at "none" to keep the median in tolerance, which would be a fit). The planner's ring rule
(tandem/plan/terms/tensor_parallel.py) over-states torch's async TP on this very report's Table 4 pair (2D 829 -> 2D +
AsyncTP 876, 1.057x; the planner 1.188x; tests/plan/terms/test_tensor_parallel.py), and that shows here: at torchtitan's 8
micro-batches (below) T5 -1.2 -> +13.7% (1F1B), -1.0 -> +14.1% (interleaved), T6 +0.2 -> +11.5%, +20.2 -> +30.0%
(CP 1 / CP 2): the table 11.5% / 58.9% (4.5% / 58.9% with "none"), a known miss on both bounds, pinned at
12% / 60%. Term at fault: what torch's async TP leaves exposed (not modelled: the ring rule hides what Transformer
Engine's userbuffers hide), besides the long-context CP rows.

Gradient sync under the pipeline (grad_sync.py; issue 14, session 8). torchtitan's 405B rows (Tables 5, 6) run
torch.distributed.pipelining over FSDP2 built with reshard_after_forward=False when PP is on (parallelize_llama.py at
eaea6f6a: "to avoid per-microbatch all-gathers"), and the pipeline stage runs every backward with
set_requires_gradient_sync(False), reducing once after the stage's last backward (torch's stage.py): parameters
gathered once a step, gradients accumulated unsharded in FP32 (reduce_dtype) and reduce-scattered once
(pp_grad_sync "step"). The published memory agrees: 82.5 / 72.7 / 75.3 / 75.9 GiB against the planner's 52.5 /
54.3 / 65.1 / 65.1 GiB under "step" (at micro-batch 1, when written) and 18.6 / 20.2 / 31.5 / 31.5 GiB under the per-micro-batch FSDP these rows are
still planned with (test below). Under "step" the T5 rows come out +54.5% (1F1B) and +30.1% (interleaved), the
table 10.7% / 59.1%: the per-micro-batch all-gathers and reduce-scatters (11.8 s exposed of the 1F1B row's 37.8 s)
stand in for a cost these runs have that the planner does not model (about 14 s for 1F1B, 7 s interleaved: ~3.5x
each row's bubble). Planned as they ran ("step", merged by the lead: a setting chosen to keep a median in
tolerance would be a fit): with every other session-8 term, T5 1F1B +43.7%, interleaved +21.9%, the table median
10.2%, max 58.9% (the CP 8 row), pinned at 11% / 60%. The term at fault is that missing pipeline cost, not the
gradient sync. FSDP2's own copies (fsdp_copies.py) under "step" run once a step too (one copy-out, one copy-in;
torch's stage.py keeps the parameters unsharded until the last backward), not per micro-batch.

Micro-batches under PP (session 9): that missing cost was this test's input, not the planner. The rows were planned
with micro-batch 1 (32 micro-batches of T5's local batch 32), but torchtitan at the report's commit (9dec370)
splits the local batch into `experimental.pipeline_parallel_microbatches` micro-batches, default None, which
build_pipeline_schedule (torchtitan/parallelisms/pipelining_utils.py) and pipeline_llama_manual_split replace by
the pp degree (config_manager.py: "The default value will be the number of pipeline stages"), and the report names
no other value: T5 ran 8 micro-batches of 4 sequences (T6 8 of 1, as planned before). 1F1B's fill and drain are
then (p-1)/m = 7/8 of the work, not 7/32. Planned so: T5 1F1B -1.2% (was +43.7%), interleaved -1.0% (+21.9%);
the table median 4.5% (was 10.2%), max 58.9% (the CP 8 row): the median now meets the issue's 10%, the max
misses on the long-context CP rows (pinned at 5% / 60%). With a reduction each micro-batch instead of once a step
(`microbatch`) the T5 rows would be -2.0% / -2.1%: the schedule's bubble, not the gradient sync, moved them.
Memory (test below): 63.6 / 58.6 / 63.6 / 63.6 GiB planned against 82.5 / 72.7 / 75.3 / 75.9 published (65.1 /
60.1 / 65.1 / 65.1 before ZeRO-3's gather buffers were dropped under "step", where the stage's parameters are
already counted unsharded; was 52.5 / 54.3 for T5 at micro-batch 1). The report's figure is torch.cuda's peak *reserved* bytes (torchtitan
9dec370 train.py logs device_memory_monitor.get_peak_stats().max_reserved_gib: "reserved_bytes.all.peak"), which
holds the caching allocator's cached and fragmented blocks as well as live tensors, so the rest of the gap is not
a count of tensors. Read in torch's stage.py (PipelineStage: _setup_forward_recv_info, _create_grad_recv_info, per
micro-batch; fwd_cache) and not modelled: one activation and one gradient receive buffer a micro-batch, allocated
once and kept (b x s/tp x h x 2 B each: 0.125 GiB at T5's and T6's shapes, 1 GiB a kind at 8 micro-batches), and
each in-flight micro-batch's stage output kept for its backward: about 2 GiB on the first rank (1F1B) and 4 GiB
(interleaved, two stages a rank), which would widen the interleaved row's share where the report's is smaller.
Issue 29 (session planmem): those are now counted (memory.pipeline_buffers, the runtime's pp_outputs "all": at torch
1963fc8 every stage kept all its outputs in output_chunks, since PR #153383 only the last; the inputs' gradients
stayed in the receive buffers' .grad until PR #164329), and the last stage's loss is counted during its backwards
only: T5 1F1B -15.6% (its peak on the last rank, 8 micro-batches of bf16 logits kept), interleaved -3.4%, T6 -7.5% /
-8.2%. The interleaved row's report is 10 GiB under 1F1B's and T6's CP 1 row 7 GiB under it at the same tensor
sizes: the allocator, not a count (the memory tests below).
"""

from statistics import median


from tandem.plan.cost import evaluate, validate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

LLAMA = dict(gated=True, bias=False, norm="rmsnorm", tied=False, learned_pos=False)
L3 = dict(vocab=128256, kv_heads=8, **LLAMA)
SHAPES = {
    "llama3.1-8b": dict(layers=32, hidden=4096, heads=32, ffn=14336, **L3),
    "llama3.1-70b": dict(layers=80, hidden=8192, heads=64, ffn=28672, **L3),
    "llama3.1-405b": dict(layers=126, hidden=16384, heads=128, ffn=53248, **L3),
    "llama2-13b": dict(layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000, **LLAMA),
    "llama2-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, **LLAMA),
}
# commit eaea6f6a: table, model, seq, GPUs, fsdp (dp), tp, pp, cp, local batch, recompute, precision, TPS/GPU
H100 = [
    ("T1 FSDP", "llama3.1-8b", 8192, 8, 8, 1, 1, 1, 2, "selective", "bf16", 5762),
    ("T1 FSDP+compile+Float8", "llama3.1-8b", 8192, 8, 8, 1, 1, 1, 2, "selective", "fp8", 8532),
    ("T2 FSDP 8 CP 1", "llama3.1-8b", 32768, 8, 8, 1, 1, 1, 1, "full", "fp8", 3890),
    ("T2 FSDP 4 CP 2", "llama3.1-8b", 65536, 8, 4, 1, 1, 2, 1, "full", "fp8", 2540),
    ("T2 FSDP 2 CP 4", "llama3.1-8b", 131072, 8, 2, 1, 1, 4, 1, "full", "fp8", 1071),
    ("T2 FSDP 1 CP 8", "llama3.1-8b", 262144, 8, 1, 1, 1, 8, 1, "full", "fp8", 548),
    ("T3 FSDP", "llama3.1-8b", 8192, 128, 128, 1, 1, 1, 2, "selective", "bf16", 5605),
    ("T3 FSDP+compile+Float8", "llama3.1-8b", 8192, 128, 128, 1, 1, 1, 2, "selective", "fp8", 8380),
    ("T4 2D", "llama3.1-70b", 8192, 256, 32, 8, 1, 1, 16, "full", "fp8", 829),
    ("T5 1F1B", "llama3.1-405b", 8192, 512, 8, 8, 8, 1, 32, "full", "fp8", 100),
    ("T5 Interleaved 1F1B", "llama3.1-405b", 8192, 512, 8, 8, 8, 1, 32, "full", "fp8", 128),
    ("T6 FSDP 8 CP 1", "llama3.1-405b", 32768, 512, 8, 8, 8, 1, 8, "full", "fp8", 76),
    ("T6 FSDP 4 CP 2", "llama3.1-405b", 65536, 512, 4, 8, 8, 2, 8, "full", "fp8", 47),
]
# commit 04133643: model, local batch, activation checkpointing, WPS (64 A100-80GB, FSDP 64)
A100 = [
    ("llama3.1-8b", 1, "selective", 2904), ("llama3.1-70b", 1, "full", 331), ("llama2-13b", 2, "none", 2162),
    ("llama2-13b", 2, "selective", 1914), ("llama2-70b", 1, "selective", 355), ("llama2-70b", 2, "full", 353),
]
KNOWN_MISS = {"h100": (0.12, 0.60)}   # (median, max) pinned: see KNOWN MISSES


def torchtitan_chunks(layers: int, chunks: int) -> tuple[int, ...]:
    """torchtitan's default split (generate_split_points, no split points given): `layers // chunks` a chunk,
    one more on each of the middle chunks after the first while the remainder lasts."""
    base, extra = divmod(layers, chunks)
    return tuple(base + (1 if 0 < i <= extra and i < chunks - 1 else 0) for i in range(chunks))


def _plan(name, seq, gpu, gpus, inter, dp, tp, pp, cp, local, recompute, precision, interleaved=False,
          kernels=None, tp_overlap="none"):
    m = gpt_stats(GPTShape(seq=seq, **SHAPES[name]), name)
    c = make_cluster(gpu, 8, gpus // 8, inter=inter, nics_per_node=8)
    # torchtitan's FSDP2 reduce-scatters in FP32 (its config: mixed_precision_reduce = "float32" by default);
    # the Float8 rows ran with torch.compile (the report has no Float8 row without it), the BF16 rows without;
    # attention: PyTorch SDPA's flash backend (FlashAttention-2)
    t = Training(global_batch=local * dp, precision=precision, optimizer="adamw", attention_kernel="fa2",
                 cp_impl="torch", grad_reduce="fp32", kv_repeat=True, runtime="torchtitan",
                 fused_loss=False,   # train.py: F.cross_entropy(pred.float()), uncompiled (it compiles the blocks)
                 kernels=kernels or ("compiled" if precision == "fp8" else "eager"),
                 # under PP, torch's pipelining reduces FSDP2's gradients once a step (docstring: gradient sync)
                 pp_grad_sync="step", tp_overlap=tp_overlap)
    # interleaved: 2 stages a rank, torchtitan's default for its multi-stage schedules (generate_split_points)
    pipe = dict(schedule="interleaved", virtual=2, stage_layers=torchtitan_chunks(m.gpt.layers, 2 * pp)) \
        if interleaved else {}
    # under PP torchtitan splits the local batch into pipeline_parallel_microbatches, default the pp degree
    # (9dec370: pipelining_utils.build_pipeline_schedule, config_manager.py): T5's 32 sequences run as 8 of 4
    s = Strategy(dp=dp, tp=tp, pp=pp, cp=cp, zero=3, micro_batch=local // pp if pp > 1 else local,
                 recompute=recompute, ranks_per_node=8, **pipe)
    validate(m, c, t, s)
    return evaluate(m, c, t, s)


def h100_errors() -> dict[str, float]:
    out = {}
    for label, name, seq, gpus, dp, tp, pp, cp, local, rc, prec, tps in H100:
        # Tables 5 and 6 ran async TP ("+ AsyncTP" in their captions): planned with it (docstring: Async TP)
        p = _plan(name, seq, "h100-sxm-500w", gpus, "ib-ndr", dp, tp, pp, cp, local, rc, prec, "Interleaved" in label,
                  tp_overlap="ring" if label[:2] in ("T5", "T6") else "none")
        out[f"{label} {name}"] = local * dp * seq / p.step_s / gpus / tps - 1
    return out


def a100_errors() -> dict[str, float]:
    out = {}
    for name, local, rc, wps in A100:
        seq = 8192 if name.startswith("llama3") else 4096
        p = _plan(name, seq, "a100-80gb", 64, "ib-hdr", 64, 1, 1, 1, local, rc, "bf16")
        out[f"{name} {rc}"] = local * seq / p.step_s / wps - 1
    return out


def test_h100_tokens_per_gpu_known_miss():
    errs = {k: abs(e) for k, e in h100_errors().items()}
    med_bound, max_bound = KNOWN_MISS["h100"]
    assert median(errs.values()) <= med_bound, errs
    assert max(errs.values()) <= max_bound, errs


def test_a100_tokens_per_gpu_within_the_issue_tolerance():
    errs = {k: abs(e) for k, e in a100_errors().items()}
    assert median(errs.values()) <= 0.10, errs
    assert max(errs.values()) <= 0.25, errs


def test_float8_speedup_over_bf16_is_predicted_within_the_tolerance():
    """Float8 over BF16 at the same layout: the Float8 rows also ran with torch.compile (bandwidth_bound.py "compiled";
    the compute rate is not otherwise changed by it), so the reference is the report's compiled BF16 row (Table 1:
    8532 / 6667 = 1.280, Table 3: 8380 / 6514 = 1.286). The ratio cancels the power cap and the base efficiency: what remains is FP8 on the linear layers only,
    FP8's lower share of its peak and its casts (efficiency.py, gemm.py). Predicted: 1.328, 1.326; both rows with
    compiled kernels and the memory-bound ops charged (bandwidth_bound.py): 1.304, 1.308."""
    for t, compiled in (("T1", 6667), ("T3", 6514)):
        row = next(r for r in H100 if r[0] == f"{t} FSDP+compile+Float8")
        fp8 = _plan(*row[1:3], "h100-sxm-500w", row[3], "ib-ndr", *row[4:11])
        # the BF16 row as it would run compiled (bandwidth_bound.py "compiled"), the reference the report gives
        bf16 = _plan(*row[1:3], "h100-sxm-500w", row[3], "ib-ndr", *row[4:10], "bf16", kernels="compiled")
        predicted = bf16.step_s / fp8.step_s
        assert abs(predicted / (row[-1] / compiled) - 1) <= 0.10, (t, predicted)


# The report's Memory(GiB) column (eaea6f6a docs/performance.md, read at its commit in the torchtitan mirror): torch.cuda's
# peak *reserved* bytes (max_reserved_gib), the caching allocator's cache and fragmentation included, so a count of
# tensors comes out at or under it
PUBLISHED_MEMORY_GIB = {"T1 FSDP": 82.4, "T1 FSDP+compile+Float8": 76.8, "T2 FSDP 8 CP 1": 83.9,
                        "T2 FSDP 4 CP 2": 84.2, "T2 FSDP 2 CP 4": 84.0, "T2 FSDP 1 CP 8": 84.5, "T3 FSDP": 67.0,
                        "T3 FSDP+compile+Float8": 61.8, "T4 2D": 71.9, "T5 1F1B": 82.5, "T5 Interleaved 1F1B": 72.7,
                        "T6 FSDP 8 CP 1": 75.3, "T6 FSDP 4 CP 2": 75.9}
# issue 29, the planner's error per row before its memory terms (Korthikanti's selective, 4 B fp32 logits, two
# gathered layers): T1 +18.6% / +27.3%, T2 -45.1..-45.5%, T3 +25.0% / +35.5%, T4 -47.3%, T5 -22.9% / -19.4%,
# T6 -15.5% / -16.2%; after (torchtitan's per-op selective checkpointing, the unfused loss's 12 B a logit, FSDP2's
# root, blocks and gradients in flight, torch TP's gathered matmul inputs): T1 -6.9% / -0.1%, T2 -4.2..-4.9%,
# T3 -6.4% / +1.5%, T4 -16.5%, T5 -20.8% / -11.6%, T6 -13.2% / -13.9%; then (torch's loss_parallel backward, 16 B a
# logit under tp; torch 1963fc8's pipelining buffers under PP; the last stage's loss live at its backwards only):
# T4 -5.7%, T5 -15.6% / -3.4%, T6 -7.5% / -8.2%, T1-T3 unchanged
MEMORY_1D = ("T1", "T2", "T3")   # FSDP (+ CP) alone: within issue 29's 10% a cell
MEMORY_KNOWN_MISS = {"T5 1F1B": 0.17}   # under the reserved peak by at most this: see its test


def memory_errors() -> dict[str, float]:
    out = {}
    for label, name, seq, gpus, dp, tp, pp, cp, local, rc, prec, _ in H100:
        p = _plan(name, seq, "h100-sxm-500w", gpus, "ib-ndr", dp, tp, pp, cp, local, rc, prec, "Interleaved" in label,
                  tp_overlap="ring" if label[:2] in ("T5", "T6") else "none")
        out[label] = p.memory.total / (PUBLISHED_MEMORY_GIB[label] * 1024**3) - 1
    return out


def test_fsdp_memory_against_the_allocator_peaks():
    """Issue 29: per cell within 10% of the published allocator peak for FSDP and FSDP + CP, short (8k) and long
    (32k tokens a GPU) sequence. Nothing fitted: each term is a count of the tensors torchtitan 9dec370 holds
    (terms/memory.py: loss_bytes, op_sac, fsdp_inflight_bytes)."""
    errs = memory_errors()
    one_d = {k: e for k, e in errs.items() if k[:2] in MEMORY_1D}
    assert len(one_d) == 8 and all(abs(e) <= 0.10 for e in one_d.values()), one_d


def test_2d_and_pipeline_memory_against_the_allocator_peaks():
    """Issue 29: FSDP + TP (T4, 70B, 256 GPUs) and FSDP + TP + PP (+ CP) (T5 interleaved, T6, 405B, 512 GPUs) within
    10% a cell, each under the reserved peak (a count of tensors). The terms that moved them, each read in its source:
    - T4 -16.5% -> -5.7%: under tp torchtitan's loss is torch's loss_parallel (parallelize_llama.py: the output layer
      ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), train_context's loss_parallel), whose
      backward (tensor/parallel/loss.py, _nll_loss_and_log_softmax_backward) holds 16 B a logit, not 12
      (memory.loss_bytes; measured in tests/plan/terms/test_memory.py). What TP with sequence parallel keeps sharded
      was already counted as torchtitan's plan has it: the blocks' inputs, norms and residual stream / tp
      (SequenceParallel, RowwiseParallel(output_layouts=Shard(1))), the two all-gathered matmul inputs whole.
    - T5 interleaved -11.6% -> -3.4%, T6 -13.2% / -13.9% -> -7.5% / -8.2%: torch's pipelining at the report's torch
      (1963fc8, memory.pipeline_buffers): a receive buffer per micro-batch, every stage's outputs and its inputs'
      gradients kept to the step's end (the last stage's are its bf16 logits), and the loss counted during the last
      stage's backwards only (it had been added at every rank's peak).
    The activations add the loss's peak and the recomputed layer's working set, which are not live at once
    (docs/plan.md, under the memory tables): with the larger of the two instead, T4 -16.7%, T6 -12.6% / -13.3%."""
    errs = {k: e for k, e in memory_errors().items() if k[:2] not in MEMORY_1D and k not in MEMORY_KNOWN_MISS}
    assert len(errs) == 4 and all(-0.10 <= e < 0 for e in errs.values()), errs


def test_1f1b_405b_memory_known_miss():
    """KNOWN MISS: T5 1F1B (405B, FSDP 8 x TP 8 x PP 8, 8 micro-batches of 4 x 8192 tokens) -15.6% (was -20.8%): 69.7
    GiB against 82.5 reserved. Not a count of tensors: T6's CP 1 row runs the same model, layout, schedule and
    micro-batch count at the same tokens a micro-batch (1 x 32768), so every term here (blocks' inputs, receive
    buffers, kept outputs and logits, the loss, FSDP2's unsharded parameters and FP32 gradients) is the same size,
    and it published 75.3 GiB, 7.2 GiB under this row. What differs is the caching allocator's reserve and
    fragmentation (torch.cuda's reserved_bytes.all.peak, the report's figure), which no source gives a number for
    across workloads (--allocator-reserve, default 0). Pinned just past what is measured, under the peak."""
    errs = {k: e for k, e in memory_errors().items() if k in MEMORY_KNOWN_MISS}
    assert len(errs) == 1 and all(-MEMORY_KNOWN_MISS[k] <= e < 0 for k, e in errs.items()), errs


def test_pipeline_rows_memory_says_gradients_are_reduced_once_a_step():
    """The 405B pipeline rows' published memory is far closer to FSDP2 under torch's pipelining (unsharded
    parameters and FP32 gradients, one reduction a step) than to per-micro-batch FSDP, which misses 50+ GiB."""
    import dataclasses

    for label, name, seq, gpus, dp, tp, pp, cp, local, rc, prec, _ in H100:
        if label[:2] not in ("T5", "T6"):
            continue
        step = _plan(name, seq, "h100-sxm-500w", gpus, "ib-ndr", dp, tp, pp, cp, local, rc, prec,
                     "Interleaved" in label)
        t = dataclasses.replace(step.training, pp_grad_sync="microbatch")
        micro = evaluate(step.model, step.cluster, t, step.strategy)
        pub = PUBLISHED_MEMORY_GIB[label] * 1024**3
        assert micro.memory.total < step.memory.total < pub, label
        assert pub - step.memory.total < (pub - micro.memory.total) / 2, label
