"""Step time at 2,240 to 3,360 GPUs: Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG
530B, A Large-Scale Generative Language Model" (Microsoft and NVIDIA, arXiv:2201.11990), §2.4 (system throughput):
the 530B model (§3.2: 105 layers, hidden 20480, 128 heads, sequence 2048, global batch 1920; 8-way tensor slicing
inside a node, 35-way pipeline across nodes, data parallelism the rest) on 280, 350 and 420 DGX A100 servers
(Selene: 8 x A100 80GB on NVLink/NVSwitch, 8 x HDR InfiniBand a server), iteration times 60.1, 50.2 and 44.4 s,
i.e. 126, 121 and 113 teraFLOP/s per GPU. The numbers were read from two transcriptions in the stored corpus: the
llm-analysis example for MT-NLG (cli99/llm-analysis, examples/megatron-turing-nlg/README.md, "Section 2.4 ... 60.1,
50.2, and 44.4 seconds ... 126, 121, and 113 TFLOP/s per GPU") and a dataset of published runs quoting the paper's
page 7 (find_string "60.1, 50.2, and 44.4"), which also quotes the PaLM paper's App. B for the 280-server row:
65.43K tokens/s = 1920 x 2048 / 60.1 s.

The planner gets the stated layout: A100-80GB, 8 a node, 8 x ib-hdr, TP 8 / PP 35 / dp 8, 10, 12, batch 1920,
Adam. From DeepSpeed's pipeline engine, which MT-NLG ran (deepspeed/runtime/pipe/schedule.py, TrainSchedule):
plain 1F1B (no interleaving), and ReduceTiedGrads / ReduceGrads / OptimizerStep issued after the last micro-batch,
so the data-parallel reduction is not overlapped (--overlap 0); ZeRO stage 1 for the data-parallel optimizer
states (DeepSpeed's ZeRO tutorial on MT-NLG). Unstated, chosen before comparing and named here: micro-batch 1
(Megatron-LM's 529.6B row, Narayanan et al. 2021 Table 1); vocabulary 51200 (GPT-2's 50257 padded by Megatron to a
multiple of 128 x tp, as Korthikanti et al. §6 give for this model); full activation recomputation, which the
paper's FLOP count implies (126 TFLOP/s x 60.1 s is the planner's hardware FLOPs with one recomputed forward, to
0.2%: test below); unfused attention (2021, before FlashAttention). FP16 (the paper says "mixed precision"):
DeepSpeed's pipeline engine took BF16 only in April 2022 (microsoft/DeepSpeed #1801), and NVIDIA's Megatron-LM
script for this shape on Selene (gpt3-530b: TP 8, PP 35, --micro-batch-size 1, --fp16, --loss-scale 8192,
--checkpoint-activations, GPT-2 BPE) runs FP16 too; BF16 was planned here before that was read (+0.3% a row).

Input audit (issue 14; the torchtitan 405B rows' miss was a wrong input), each against its source: shape, sequence,
batch 1920 (§3.2; §2.4 measures at 1920, so the ramp-up from 32 of §3.2 does not apply), servers and GPU (§2.3-2.4:
DGX A100, 8 x A100 80GB, HDR InfiniBand, 8 HCAs a server), TP 8 / PP 35 (§2.2), Adam (§3.2): kept. DeepSpeed's
engine of January 2022 (deepspeed/runtime/pipe/, read at 9351266f): ZeRO below stage 2 (engine.py asserts it:
ZeRO-1 kept), micro-batches = gradient_accumulation_steps = 1920 / (1 x dp), 240 down to 160 (kept), plain 1F1B
with no interleaving (schedule.py TrainSchedule, kept), ReduceTiedGrads (the tied embedding's all-reduce) and
ReduceGrads after the last micro-batch (no overlap: kept; the embedding term is charged), blocking dist.send /
dist.recv (p2p.py asserts async_op False; the planner counts blocking sends), ZeRO-1's gradient "reduce_scatter"
(default on) as one dist.reduce of each owner's slice (zero/stage_1_and_2.py average_tensor: the bytes of a
reduce-scatter, kept). Megatron-DeepSpeed's GPTModelPipe partitions with 'type:transformer': 3 layers a stage,
the embedding on the first and the tied output layer on the last, the planner's own split (kept). Micro-batch 1,
full recompute and the padded vocabulary (51,200) are Megatron's for this shape (the script above). The engine
splits each activation and gradient it sends over the tensor-parallel ranks (engine.py is_pipe_partitioned /
is_grad_partitioned, PartitionedTensor, gathered on receipt), as Megatron's scatter-gather does: b x s x h / tp a
send, as planned (kept). Changed: BF16 -> FP16. Unstated, not modelled: DeepSpeed's activation checkpointing
options (partition_activations, contiguous checkpointing), which no source read gives for this run.

Measured when written: -21.7%, -22.8%, -25.1% (280, 350, 420 servers): median 22.8%, max 25.1%, every row FAST.
With the fill and drain repeating each micro-batch's tensor-parallel communication (pipeline.py): median
21.9%, max 24.1% (the fixed part of a step 6.1 s against the table's 12.7 s). In FP16 (the input audit): -21.3%,
-22.2%, -24.5%: median 22.2%, max 24.5% (FP16 gradients reduced in FP16 where Megatron's BF16 reduces FP32).
KNOWN MISS on both bounds (test_step_time_known_miss, pinned just above). Sensitivity: ZeRO 0 or BF16 gradient
reduction move a row by 0.3%; FlashAttention-2 -25.5..-28.7%; selective recompute -37..-40%: no unstated choice
closes it.

Planned under the runtime that ran it (issue 29), `--runtime deepspeed-2021` (tandem/plan/inputs/runtime.py): one
end-to-end 0.50 of peak for every FLOP, the planner's default before the per-architecture model (Narayanan et al.
2021's 44-52% of A100 peak at scale; not fitted to these rows), eager attention, ZeRO-3 gathers exposed (no ZeRO-3
here): +2.5%, +1.2%, -1.7% (280, 350, 420 servers), a pass (test_step_time_under_its_runtime). The split is still
off: fit over the rows, the planner's a = 0.225 s a micro-batch (table 0.197) and b = 7.7 s a step (table 12.7):
the one rate overcharges each micro-batch by ~14% and the fixed part stays ~5 s short; the pass rests on one
publication (the only DeepSpeed-era table in the repository). Under tandem's default rules (the fine-grained
per-architecture model, which meets Megatron-LM's own 163 TFLOP/s for this shape) the rows stay the known miss
below: the runtime, not a term, was what the planner did not describe.

Where the miss is under tandem's rules (test_miss_is_the_framework_known_miss): the planner times Megatron-LM. On the same model and
machine Megatron-LM measured 163 TFLOP/s on 2,520 GPUs (Narayanan et al. 2021, Table 1, 529.6B, batch 2520, 1F1B,
full recompute) and the planner says 164 (+0.7%); MT-NLG's own 126 is 23% under that. Fitting step = a x m + b
over the three rows (m = 1920 / dp micro-batches, 240 down to 160): the table's a = 0.197 s a micro-batch and
b = 12.7 s a step, the planner's a = 0.172 s and b = 6.0 s (of which 5.15 s is the 1F1B fill/drain; FP16). So DeepSpeed's
engine as run in 2021 costs ~14% more a micro-batch and ~7 s more a step than the planner's Megatron-LM model.
Term at fault: the framework (DeepSpeed's PipelineEngine as run in 2021), which the planner does not describe;
nothing in it was fitted to close the gap. Not its schedule: TrainSchedule with its blocking p2p, modelled event by
event (deepspeed_schedule.py, test_deepspeed_schedule_is_1f1b_plus_blocking_transfers), is the planner's 1F1B plus
4 transfers a micro-batch and 62 a step on the critical path, ~1% and ~0.03 s at 0.44 ms a partitioned send. Not
its end-of-step reductions either: ZeRO-1's reduce and all-gather of FP16 over dp 8-12 are ~0.3 s, charged. Left:
~13% a micro-batch and ~6.7 s a step that no input and no part of the engine read here accounts for (DeepSpeed's
activation-checkpointing options and its per-instruction host overheads were not sized).
"""

from statistics import median

import pytest

from tandem.plan.cost import evaluate, validate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training
from tests.plan.published_fit import fit

MT_NLG = GPTShape(layers=105, hidden=20480, heads=128, seq=2048, vocab=51200)
TP, PP, BATCH = 8, 35, 1920
# DGX A100 servers, iteration time (s), teraFLOP/s per GPU (§2.4)
ROWS = [(280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)]
MEGATRON_530B = (2520, 2520, 163)   # Narayanan et al. 2021 Table 1: GPUs, batch, TFLOP/s (same shape)


def _plan(servers: int, runtime: str = "tandem"):
    m = gpt_stats(MT_NLG, "mt-nlg-530b")
    c = make_cluster("a100-80gb", 8, servers, inter="ib-hdr", nics_per_node=8)
    # DeepSpeed's TrainSchedule reduces gradients after the last micro-batch: nothing overlapped
    # FP16 with dynamic loss scaling, not BF16: DeepSpeed's pipeline engine took BF16 only in April 2022 ("bf16 +
    # pipeline parallelism", microsoft/DeepSpeed #1801, 56c52238), after MT-NLG's 2021 training and this paper; the
    # engine of January 2022 (deepspeed/runtime/pipe/engine.py) scales the loss for fp16 only. FP16 gradients are
    # reduced as FP16 (collectives.grad_reduce_bytes), as DeepSpeed's ZeRO-1 does.
    t = Training(global_batch=BATCH, precision="fp16", optimizer="adam", overlap=0.0, runtime=runtime)
    s = Strategy(dp=servers * 8 // (TP * PP), tp=TP, pp=PP, zero=1, micro_batch=1, recompute="full",
                 ranks_per_node=8)
    validate(m, c, t, s)
    return evaluate(m, c, t, s)


def errors(runtime: str = "deepspeed-2021") -> dict[int, float]:
    return {servers * 8: _plan(servers, runtime).step_s / it - 1 for servers, it, _ in ROWS}


def SCOREBOARD() -> dict[str, dict]:
    return {"mt-nlg 530B": errors()}


def test_step_time_under_its_runtime():
    """Planned as DeepSpeed's 2021 engine runs (--runtime deepspeed-2021): +2.5%, +1.2%, -1.7%, within issue 14's
    10% median / 25% max; pinned at 4%."""
    errs = errors("deepspeed-2021")
    assert all(abs(e) <= 0.04 for e in errs.values()), errs
    # the split the pass hides (module docstring): ~14% over a micro-batch, ~5 s short a step
    ms = [BATCH // (s * 8 // (TP * PP)) for s, _, _ in ROWS]
    a_p, b_p = fit(ms, [_plan(s, "deepspeed-2021").step_s for s, _, _ in ROWS])
    assert 1.10 <= a_p / 0.197 <= 1.18 and 0.55 <= b_p / 12.7 <= 0.65, (a_p, b_p)


def test_hardware_flops_per_step_match_the_paper():
    """TFLOP/s x iteration time (the paper's FLOPs per GPU per step) against the planner's hardware FLOPs with
    full recompute: the shape, batch and FLOP accounting agree before any time is compared."""
    for servers, it, tflops in ROWS:
        p = _plan(servers)
        assert p.hw_flops_per_gpu == pytest.approx(tflops * 1e12 * it, rel=0.01), servers
        assert p.memory.fits, (servers, p.memory.total / 2**30)


def test_step_time_known_miss():
    """KNOWN MISS under tandem's rules (a pass under deepspeed-2021's, above): median 22.8%, max 25.1% (every row fast); 21.9% / 24.1% with the fill's tp communication; 22.2% /
    24.5% in FP16 after the input audit (module docstring), pinned just above. Term at fault: the framework
    (DeepSpeed's 2021 pipeline engine against the planner's Megatron-LM model; module docstring)."""
    errs = {k: abs(e) for k, e in errors("tandem").items()}
    assert all(e < 0 for e in errors("tandem").values())
    assert median(errs.values()) <= 0.23, errs
    assert max(errs.values()) <= 0.25, errs


def test_miss_is_the_framework_known_miss():
    """KNOWN MISS, located: the planner meets Megatron-LM's own measurement of this shape on this machine, and
    the MT-NLG table is slower than both per micro-batch and per step."""
    gpus, batch, tflops = MEGATRON_530B
    m = gpt_stats(MT_NLG, "mt-nlg-530b")
    c = make_cluster("a100-80gb", 8, gpus // 8, inter="ib-hdr", nics_per_node=8)
    p = evaluate(m, c, Training(global_batch=batch, precision="fp16", optimizer="adam"),
                 Strategy(dp=gpus // (TP * PP), tp=TP, pp=PP, micro_batch=1, recompute="full"))
    assert p.hw_flops_per_gpu / p.step_s / 1e12 == pytest.approx(tflops, rel=0.03)   # 164 against 163
    assert ROWS[0][2] / tflops == pytest.approx(0.773, abs=0.005)   # MT-NLG's 126 against Megatron-LM's 163
    ms = [BATCH // (s * 8 // (TP * PP)) for s, _, _ in ROWS]
    a_t, b_t = fit(ms, [it for _, it, _ in ROWS])
    a_p, b_p = fit(ms, [_plan(s).step_s for s, _, _ in ROWS])
    assert a_t == pytest.approx(0.197, abs=0.001) and b_t == pytest.approx(12.7, abs=0.1)   # the table alone
    assert 0.85 <= a_p / a_t <= 0.90, (a_p, a_t)   # 0.172 / 0.197: ~13% under a micro-batch
    assert 0.45 <= b_p / b_t <= 0.51, (b_p, b_t)   # 6.0 / 12.7: ~6.7 s a step missing (5.7 before the fill's tp)


def test_deepspeed_schedule_is_1f1b_plus_blocking_transfers():
    """DeepSpeed's TrainSchedule (tests/plan/deepspeed_schedule.py, read at 9351266f) with free transfers takes
    exactly (m + p - 1)(F + B), the planner's 1F1B; each transfer it blocks on costs 4 times a micro-batch and 62
    times a step at p = 35 (Megatron's 1F1B: 2 a micro-batch). At one transfer's time as planned (b x s x h / tp
    over one HDR port, the engine's partitioned send) that is ~1% more a micro-batch and ~0.03 s a step against
    the table's ~14% and ~7 s: the schedule is not where the miss is."""
    from tests.plan.deepspeed_schedule import step_time
    from tandem.plan.terms import collectives as comm

    p, F, B = PP, 1.0, 3.0   # full recompute: a backward is the recomputed forward + 2 forwards
    for m in (160, 240):
        assert step_time(p, m, F, B) == pytest.approx((m + p - 1) * (F + B))
    x = 0.01
    extra = [step_time(p, m, F, B, x) - (m + p - 1) * (F + B) for m in (160, 240)]
    per_mb = (extra[1] - extra[0]) / 80 / x
    fixed = (extra[0] - 160 * per_mb * x) / x
    assert per_mb == pytest.approx(4.0) and fixed == pytest.approx(62.0)
    c = make_cluster("a100-80gb", 8, 280, inter="ib-hdr", nics_per_node=8)
    send = comm.p2p(MT_NLG.seq * MT_NLG.hidden * 2 / TP, True, c)   # FP16 activation, partitioned over tp
    a_p = 0.172   # the planner's time a micro-batch (test_miss_is_the_framework_known_miss)
    assert 4 * send / a_p < 0.015, send            # ~1% a micro-batch
    assert 62 * send < 0.05, send                  # ~0.03 s a step
