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
12,288). With the per-architecture compute model: median 12.6%, max 19.2%, all rows FAST (see the known miss
below). The median rests on those two choices (2 or 12 virtual stages: 11.7%, 11.6%; selective recompute:
2.8-4.3%); the max stays within 20% under every one of them (checked below).
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
GPT_175B = GPTShape(layers=96, hidden=12288, heads=128, seq=2048, vocab=51200)


def errors(virtual: int = 6, recompute: str = "none") -> dict[int, float]:
    m = gpt_stats(GPT_175B, "megascale-175b")
    out = {}
    for batch, gpus, iter_s, _ in TABLE_2:
        c = make_cluster("a100-80gb", 8, gpus // 8, inter="roce-200", nics_per_node=8)
        t = Training(global_batch=batch, precision="bf16", optimizer="adam", overlap=0.0,
                     flash_attention=recompute == "none")
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
    every row now predicted FAST, from -5% at 256 GPUs to -19% at 12,288: the error grows with the GPU count
    at a fixed global batch (less compute a GPU, more data-parallel ranks), so the term at fault is the data-parallel communication at thousands of GPUs
    (not overlapped here, --overlap 0: exposed in full, yet too short), not the compute rate. With the
    attention-kernel model (FlashAttention-2 at its own 0.615 of A100 peak at 2048, where it ran at 0.615 / 0.8 x
    the linear layers' 0.67 = 0.515 before; MegaScale runs FlashAttention-2): median 13.05%, max 19.6%, every row
    a little faster (-5.4% at 256 GPUs to -19.6% at 12,288). Pinned just above."""
    errs = {k: abs(e) for k, e in errors().items()}
    assert median(errs.values()) <= 0.131, errs
    assert max(errs.values()) <= 0.20, errs


@pytest.mark.parametrize("virtual,recompute", [(2, "none"), (12, "none"), (2, "selective"), (6, "selective"),
                                               (12, "selective")])
def test_error_whatever_the_unstated_inputs_known_miss(virtual, recompute):
    errs = {k: abs(e) for k, e in errors(virtual, recompute).items()}
    # known miss under these alternatives (measured with the attention-kernel model: median 2.8-12.1%, max
    # 10.4-19.2%; the selective-recompute rows within the tolerance; the no-recompute rows, FlashAttention-2,
    # 1 point faster than with the kernel at 0.515 of peak)
    assert max(errs.values()) <= 0.193, errs
    assert median(errs.values()) <= 0.122, errs
