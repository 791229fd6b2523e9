"""Step time at 256 to 12,288 GPUs: Jiang et al., "MegaScale: Scaling Large Language Model Training to More Than
10,000 GPUs" (ByteDance, NSDI 2024, arXiv:2402.15627), Table 2, the Megatron-LM rows (the paper's own baseline
runs: 175B model, Table 1's shape, 128 heads, hidden 12288, 96 layers, TP 8, PP 8; batch 768 on 256-1024 GPUs and
6144 on 3072-12288; Ampere GPUs, 8 x 200 Gb/s NICs a node), Iter Time (s) as the expected number. The rows were
read from a structured transcription of the paper in the stored corpus (find_string "Megatron-LM | 12288"); its
headline row (12,288 GPUs: MegaScale 55.2% MFU, 1.34x Megatron-LM's 41.2%) agrees with the paper's abstract.
The MegaScale rows themselves are not used: parallel transformer blocks, sliding-window attention and LAMB
change the model, which the planner does not describe.

The planner gets A100-80GB, 8 a node, 8 x roce-200, the shape (sequence 2048 and vocabulary 51200, GPT-3's: not
in the table), TP 8 / PP 8 / dp the rest, micro-batch 1, bf16, Adam, ZeRO-1 (Megatron's distributed optimizer)
with data-parallel communication NOT overlapped (--overlap 0: MegaScale's Table 3 lists "DP overlap" among its
own additions over this baseline), the interleaved 1F1B schedule the paper says its Megatron-LM baseline runs,
and its default efficiency. Two inputs are unstated and were chosen before comparing: 6 virtual stages (NVIDIA's
GPT-3 175B recipe at PP 8, NeMo's table in test_published_nemo_fp8.py) and no recompute with fused attention.

Measured on main when written: median 9.5%, max 19.6%, all rows predicted SLOW (+20% at 256 GPUs, 0% at
12,288). With the per-architecture compute model: median 12.6%, max 19.2%, all rows FAST. With Megatron-LM's BF16
gradients reduce-scattered in FP32 (comm.grad_reduce_bytes: its arguments.py forces
accumulate_allreduce_grads_in_fp32 for --bf16): median 11.5%, max 16.5%, all rows fast, -4.5% at 256 GPUs to
-16.5% at 12,288 (see the known miss below). The median rests on the two unstated choices (2 or 12 virtual
stages: 10.6%, 10.5%; selective recompute: 3.7-4.2%, max 10.8-12.2%).
With A100 unfused attention at its measured 0.156 of peak and the selective rows timed with FlashAttention-2 as
MegaScale runs it (they were timed unfused before): 6 virtual stages 15.2% / 19.8%; 2 and 12: 14.4% / 17.4%,
14.2% / 19.4%; selective recompute at 2, 6, 12: 12.2% / 15.4%, 13.1% / 17.9%, 12.1% / 17.5% (median / max), so
the unstated choices no longer carry the median: selective recompute was close only because it ran slow attention.

Where the error that grows with scale comes from (test_fixed_time_per_step_known_miss): fit step = a x m + b over
the four batch-768 rows (m = 768 / dp micro-batches per step, 192 down to 48; tp, pp and the stage's work fixed).
The table gives a = 0.195 s a micro-batch and b = 2.61 s a step; the planner a = 0.194 s (within 0.3%) and
b = 0.92 s. The table's b is flat in dp (the rows' residuals at the planner's a: 2.74, 2.57, 2.78, 2.58 s for dp 4,
8, 12, 16; 2.36-2.92 s for dp 96-192 on the batch-6144 rows, 4.2 s on 3,072 GPUs). So the miss is ~1.7 s a step
that does not depend on data parallelism; it looks like it grows with scale only because the per-GPU work
(a x m) shrinks. Data-parallel communication cannot be it: at a fixed stage size its ring bytes are
(n-1)/n x constant, and its latency grows with dp (the planner's DP term: 0.53 s at dp 4, 0.70 s at dp 192,
already exposed in full and in FP32). A large ring's busbw does not fall with the node count at large messages
either (NVIDIA/nccl #1712: ring bandwidth "basically the same" at the maximum size, latency linear in ranks), and
MegaScale's fabric keeps ECMP collisions down (section 3.6: uplinks at twice the downlinks). MegaScale's own
ablation (Table 3, 256 GPUs, batch 256) names the other per-step terms its baseline exposes: "PP overlap"
(decoupled warm-up/cool-down sends) 55.5% -> 58.0% MFU, ~0.55 s of a ~12.7 s step; "DP overlap" 58.0% -> 59.5%,
~0.31 s (the planner's exposed DP term at dp 4 is 0.53 s); "misc" (data loading off the critical path) ~0.2 s:
pipeline fill/drain and p2p (stages.py), data loading and the optimizer step, not modelled here.
"""

from statistics import median

import pytest

from tandem.plan.config import Strategy, Training
from tandem.plan.cost import evaluate, validate
from tandem.plan.hardware import make_cluster
from tandem.plan.model import GPTShape, gpt_stats

# Batch, GPUs, Iter Time (s), MFU (Megatron-LM rows of Table 2)
TABLE_2 = [(768, 256, 40.0, 0.530), (768, 512, 21.2, 0.499), (768, 768, 15.2, 0.467), (768, 1024, 11.9, 0.447),
           (6144, 3072, 29.02, 0.487), (6144, 6144, 14.78, 0.478), (6144, 8192, 12.24, 0.433),
           (6144, 12288, 8.57, 0.412)]
GPT_175B = GPTShape(layers=96, hidden=12288, heads=128, seq=2048, vocab=64000)


def errors(virtual: int = 6, recompute: str = "none") -> dict[int, float]:
    m = gpt_stats(GPT_175B, "megascale-175b")
    out = {}
    for batch, gpus, iter_s, _ in TABLE_2:
        c = make_cluster("a100-80gb", 8, gpus // 8, inter="roce-200", nics_per_node=8)
        # MegaScale runs FlashAttention-2 whatever the recompute: the kernel sets the time (and, fused, no s x s
        # scores are stored; selective recompute would drop them anyway)
        t = Training(global_batch=batch, precision="bf16", optimizer="adam", overlap=0.0, attention_kernel="fa2")
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
    without them (memory_bound.py, efficiency.py 0.67 -> 0.71): median 15.0%, max 19.5%, every row fast (the time
    a micro-batch now 4% short of the table's, the fixed part still a third). With the
    attention-kernel model (FlashAttention-2 at its own 0.615 of A100 peak at 2048, where it ran at 0.615 / 0.8 x
    the linear layers' 0.67 = 0.515 before; MegaScale runs FlashAttention-2): median 13.05%, max 19.6%, every row
    a little faster (-5.4% at 256 GPUs to -19.6% at 12,288). With both: median 15.2%, max 19.8%
    (-8.6% at 256 GPUs to -19.8% at 12,288). Pinned just above."""
    errs = {k: abs(e) for k, e in errors().items()}
    assert median(errs.values()) <= 0.16, errs
    assert max(errs.values()) <= 0.20, errs


def _fit(ms, ts):
    """Least squares t = a x m + b."""
    n = len(ms)
    mm, mt = sum(ms) / n, sum(ts) / n
    a = sum((m - mm) * (t - mt) for m, t in zip(ms, ts)) / sum((m - mm) ** 2 for m in ms)
    return a, mt - a * mm


def test_fixed_time_per_step_known_miss():
    """KNOWN MISS, located: the planner's time a micro-batch matches the table's slope over the batch-768 rows, its
    time a step independent of the micro-batch count is a third of the table's, and neither the table's nor the
    planner's fixed part grows with data parallelism (module docstring)."""
    errs = errors()
    rows = [(b // (g // 64), it, it * (1 + errs[g])) for b, g, it, _ in TABLE_2 if b == 768]
    a_t, b_t = _fit([r[0] for r in rows], [r[1] for r in rows])
    a_p, b_p = _fit([r[0] for r in rows], [r[2] for r in rows])
    assert a_t == pytest.approx(0.1946, abs=1e-4) and b_t == pytest.approx(2.61, abs=0.01)   # the table alone
    assert a_p == pytest.approx(a_t, rel=0.05)   # 0.186 against 0.195 with the A100 share at 0.71
    assert 0.34 <= b_p / b_t <= 0.40, (b_p, b_t)   # 0.92 / 2.61 = 0.35: ~1.7 s a step missing
    table_fixed = [it - a_t * m for m, it, _ in rows]
    plan_fixed = [it * (1 + errs[g]) - a_p * (b // (g // 64)) for b, g, it, _ in TABLE_2]
    assert max(table_fixed) - min(table_fixed) < 0.25, table_fixed         # dp 4 -> 16: flat
    assert max(plan_fixed) - min(plan_fixed) < 0.15, plan_fixed            # dp 4 -> 192: flat too


@pytest.mark.parametrize("virtual,recompute", [(2, "none"), (12, "none"), (2, "selective"), (6, "selective"),
                                               (12, "selective")])
def test_error_whatever_the_unstated_inputs_known_miss(virtual, recompute):
    errs = {k: abs(e) for k, e in errors(virtual, recompute).items()}
    # known miss under these alternatives (measured with the per-architecture compute model: median 2.8-11.7%,
    # max 10.4-18.9%; the selective-recompute rows within the tolerance; with the memory-bound ops and the
    # A100 share re-derived without them, memory_bound.py: max up to 21.9%, median up to 16.0%; with the selective
    # rows at FlashAttention-2's speed, as MegaScale runs it: median 12.1-14.4%, max 15.4-19.4%)
    assert max(errs.values()) <= 0.20, errs
    assert median(errs.values()) <= 0.15, errs
