"""Uneven pipeline stages: the planner's split, the slowest stage's pace, the first/last stages' memory."""

import re

import pytest

from tandem.plan.cost import evaluate, validate
from tandem.plan.explain import explain
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats, preset
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.stages import balanced, head_cost, split, stage_params
from tandem.plan.units import ms

# Llama 3 405B (Dubey et al. 2024, Table 3): 126 layers, h 16384, 128 heads, 8 KV heads, FFN 53248,
# vocabulary 128,256; trained on 16 pipeline stages with one layer fewer on the first and last (§3.3.2).
LLAMA3_405B = GPTShape(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, seq=8192, vocab=128256,
                       gated=True, bias=False, norm="rmsnorm", tied=False, learned_pos=False)


def test_llama3_405b_split_is_the_papers():
    # logits: 2 h V = 4.20 GFLOP/token vs a layer's 6.91 GFLOP/token: 0.608 of a layer on the last stage
    assert head_cost(LLAMA3_405B) == pytest.approx(0.608, abs=0.001)
    assert split(LLAMA3_405B, 16) == (7,) + (8,) * 14 + (7,)


def test_balanced_split_is_even_when_layers_divide():
    assert balanced(96, 8, 0.338) == (12,) * 8           # GPT-3 175B on 8 stages
    assert balanced(30, 4, 0.0) == (7, 8, 8, 7)


def test_slowest_stage_sets_the_pace():
    # step = m x t_max + (sum t - t_max); in layer units: stages 7, 8 x 14, 7 + 0.608 -> t_max 8,
    # sum 126.608; with m = 32: 32 x 8 + 118.608 = 374.608 units, each compute_mean / (32 x 126.608/16)
    m = gpt_stats(LLAMA3_405B)
    c = make_cluster("h100-sxm", 8, 16, inter="ib-ndr", nics_per_node=8)
    t = Training(global_batch=32, efficiency=0.5)   # one rate for linear layers and attention: layer units
    s = Strategy(dp=1, tp=8, pp=16, micro_batch=1)
    validate(m, c, t, s)
    p = evaluate(m, c, t, s)
    assert p.stage_layers == split(LLAMA3_405B, 16)
    unit = p.hw_flops_per_gpu / p.rate / (32 * 126.608 / 16)
    # (the fill and drain also repeat each micro-batch's tp all-reduces: bubble_comm_s, terms/test_pipeline.py)
    assert p.compute_s + p.bubble_s - p.bubble_comm_s == pytest.approx(unit * 374.608, rel=1e-4)
    assert p.stage_imbalance == pytest.approx(8 / (126.608 / 16), rel=1e-4)
    text = " ".join(explain(p))
    assert "stages hold 7,8," in text and "logits" in text


def test_explicit_stages_and_the_last_stage_with_logits():
    m = preset("llama2-7b")   # logits 0.556 of a layer
    c = make_cluster("a100-80gb", 8, 1)
    t = Training(global_batch=16)
    even = evaluate(m, c, t, Strategy(dp=1, tp=2, pp=4, micro_batch=1))
    assert even.stage_layers == (8, 8, 8, 8)
    assert even.stage_imbalance == pytest.approx(8.556 / (32.556 / 4), rel=1e-3)
    given = Strategy(dp=1, tp=2, pp=4, micro_batch=1, stage_layers=(9, 8, 8, 7))
    validate(m, c, t, given)
    p = evaluate(m, c, t, given)
    assert p.stage_imbalance == pytest.approx(9 / (32.556 / 4), rel=1e-3)   # the first stage is now slowest
    assert p.memory.activations > even.memory.activations                  # 9 layers in flight, not 8


def test_first_and_last_stage_hold_the_embeddings():
    g = preset("gpt3-175b").gpt
    first, *_, last = stage_params(g, (12,) * 8)
    layer = g.layer_params()
    assert first == 12 * layer + 51200 * 12288 + 2048 * 12288      # word + position embeddings
    assert last == 12 * layer + 51200 * 12288 + 2 * 12288           # tied copy of the embedding + final norm


def test_max_stage_params_is_the_max():
    from tandem.plan.terms.stages import max_stage_params
    for name, counts in (("gpt3-175b", (12,) * 8), ("llama2-7b", (9, 8, 8, 7)), ("llama2-7b", (1, 30, 1))):
        g = preset(name).gpt
        assert max_stage_params(g, counts) == max(stage_params(g, counts))


# ---- interleaved (virtual-stage) 1F1B over uneven stages

def test_equal_chunks_give_megatrons_interleaved_bubble():
    """(p-1)/v mean-stage micro-batch times (Narayanan et al. 2021 §2.2.2: bubble (p-1)/(v m) of compute)."""
    from tandem.plan.terms.stages import fill_units
    assert fill_units(((6, 6),) * 8, 1.0, 2.0, 0.0, 0.0, 16) == pytest.approx(7 / 2)
    assert fill_units(((12,),) * 8, 1.0, 2.0, 0.0, 0.0, 16) == pytest.approx(7)
    # growing chunks stall the front: chunks 1,2,1 wait like 2,2,2 (max chunk 2 of a mean 4/3)
    assert fill_units(((1, 2, 1),) * 4, 1.0, 2.0, 0.0, 0.0, 8) == pytest.approx(3 * 2 * 3 / 12)
    # m < p: each of the v-1 chunk changes waits p - m chunk times: + (v-1)(p-m)/v
    assert fill_units(((6, 6),) * 8, 1.0, 2.0, 0.0, 0.0, 4) == pytest.approx(7 / 2 + 1 * 4 / 2)


def test_126_layers_interleave_on_16_stages():
    from tandem.plan.terms.stages import chunks, first_stage_inflight
    c = chunks(LLAMA3_405B, 16, 4)
    assert c[0] == (2, 2, 2, 1) and c[1] == (2, 2, 2, 2) and c[-1] == (2, 2, 2, 1)
    # the first stage's warm-up: (v-1) x 16 + 2 x 15 + 1 = 79 chunk forwards at m = 32 (two rounds of 16),
    # 16 x 7 + 15 x 2 = 142 layers; then the steady state's 16 forwards on chunk 0 (2 layers) pair with backwards
    # on chunk 3 (1 layer): + 16, a peak of 158 (stages.schedule_order)
    assert first_stage_inflight(c[0], 16, 32) == 16 * (2 + 2 + 2 + 1) + 15 * 2 + 16
    assert first_stage_inflight((2, 2, 2, 2), 16, 32) == 158   # equal chunks: the warm-up's end is the peak
    # equal chunks: Korthikanti et al.'s L/p x p x (1 + (p-1)/(p v)) = 8 x 16 x (1 + 15/32) = 188
    assert first_stage_inflight((4, 4), 16, 32) == 188
    m = gpt_stats(LLAMA3_405B)
    c16 = make_cluster("h100-sxm", 8, 16, inter="ib-ndr", nics_per_node=8)
    t = Training(global_batch=16, efficiency=0.5)
    one = evaluate(m, c16, t, Strategy(dp=1, tp=8, pp=16, micro_batch=1))
    s = Strategy(dp=1, tp=8, pp=16, micro_batch=1, schedule="interleaved", virtual=4)
    validate(m, c16, t, s)
    four = evaluate(m, c16, t, s)
    assert four.compute_s == pytest.approx(one.compute_s) and four.bubble_s < one.bubble_s / 3.8
    assert "4 interleaved chunks a stage (first 2/2/2/1" in " ".join(explain(four))


def test_per_chunk_counts_and_impossible_splits():
    from tandem.core.errors import ConfigError
    from tandem.plan.terms.stages import chunks
    g = preset("llama2-7b").gpt   # 32 layers
    assert split(g, 4, (2, 2, 2, 2) + (3, 3, 3, 1) + (3, 3, 2, 6)) == (8, 8, 7, 9)
    assert chunks(g, 4, 3, (2, 2, 2, 2) + (3, 3, 3, 1) + (3, 3, 2, 6))[3] == (2, 1, 6)
    m, c, t = preset("llama2-7b"), make_cluster("a100-80gb", 8, 1), Training(global_batch=16)
    bad = {(9, 8, 8, 7, 0, 0, 0, 0): "chunk 4 (stage 0) has no layer",
           (8, 8, 8, 8, 0, 0): "6 counts, but pp 4 x virtual 2 takes 4",
           None: "stage 0 holds 4 layer(s), fewer than its 5"}
    for given, why in bad.items():
        s = Strategy(dp=1, tp=2, pp=4, micro_batch=1, schedule="interleaved", virtual=2 if given else 5,
                     stage_layers=given or (4, 10, 10, 8))
        with pytest.raises(ConfigError, match=re.escape(why)):
            validate(m, c, t, s)
    # per-chunk counts without --schedule interleaved: say so, not "takes 4 or 4"
    s = Strategy(dp=1, tp=2, pp=4, micro_batch=1, stage_layers=(4,) * 8)
    with pytest.raises(ConfigError, match="per-chunk counts need --schedule interleaved") as e:
        validate(m, c, t, s)
    assert "takes 4 (one per stage) or 4" not in str(e.value)


def test_micro_batches_follow_torchs_rounds():
    """torch's ScheduleInterleaved1F1B: max(1, m // p) rounds, m a multiple of them (Llama 3's tunable count)."""
    from tandem.plan.cost import check
    m, c = preset("llama2-7b"), make_cluster("a100-80gb", 8, 1)
    for gb, ok in ((24, True), (3, True), (36, True), (33, False)):
        s = Strategy(dp=1, tp=2, pp=4, micro_batch=1, schedule="interleaved", virtual=2)
        why = check(m, c, Training(global_batch=gb), s)
        assert (why is None) == ok, (gb, why)


def test_last_stage_holds_its_warm_up_under_interleaving():
    from tandem.plan.terms.stages import stage_inflight
    # rank p-1 runs (v-1) x round + 1 chunk forwards before its first backward: 3 x 16 + 1 = 49 on 16 stages,
    # rounds of 16 micro-batches: 16 on each of chunks 2, 2, 2 and one on the last chunk (1 layer); the steady
    # state's first forward on chunk 0 (2 layers) pairs with a backward on chunk 2 (2): one layer more, 98
    assert stage_inflight((2, 2, 2, 1), 16, 32, 15) == 3 * 16 * 2 + 2
    assert stage_inflight((4, 4), 16, 32, 15) == 16 * 4 + 4
    assert stage_inflight((7,), 16, 32, 15) == 7 and stage_inflight((7,), 16, 32, 0) == 7 * 16


def test_compute_and_fill_arithmetic_keep_the_optimizer_step_out_of_the_imbalance():
    """The optimizer step runs once after the last backward: the Compute line adds it after x imbalance, and the
    pipeline line's mean-stage micro-batch time leaves it out (its fill is stages.fill_units')."""
    import re

    from tandem.plan.terms import stages as ST

    m = gpt_stats(LLAMA3_405B)
    c = make_cluster("h100-sxm", 8, 16, inter="ib-ndr", nics_per_node=8)
    s = Strategy(dp=1, tp=8, pp=16, micro_batch=1)
    p = evaluate(m, c, Training(global_batch=32, flash_attention=True), s)
    assert p.optimizer_s > 0 and p.stage_imbalance > 1
    text = explain(p)
    comp = next(x for x in text if x.startswith("Compute:"))
    per_stage = p.compute_s - p.optimizer_s
    assert (f"x {p.stage_imbalance:.4g} on the slowest pipeline stage = {ms(per_stage)}, + optimizer step "
            f"{ms(p.optimizer_s)} = {ms(p.compute_s)}.") in comp
    g = m.gpt
    f, h = g.layer_fwd_flops_per_token(), g.logits_fwd_flops_per_token()
    fill = ST.fill_units(ST.chunks(g, 16, 1), f, 2 * f, h, 2 * h, p.grad_accum)
    line = next(x for x in text if x.startswith("Pipeline stages"))
    assert float(re.search(r"fill and drain ([0-9.]+) mean-stage", line).group(1)) == pytest.approx(fill, rel=1e-3)


def test_interleaved_default_split_follows_megatron():
    """Without --stage-layers an interleaved plan takes Megatron-LM's even split where pp x v divides the layers
    (get_num_layers_to_build): Nemotron-4 340B's 96 layers on 12 stages x 8 chunks (its pretraining layout) and on
    8 x 12 (NeMo's newer recipe) run, which the balanced split (7 layers on the last stage) refused; otherwise the
    balanced split with at least v layers a stage; fewer layers than chunks is refused, naming --virtual."""
    from tandem.core.errors import ConfigError
    from tandem.plan.terms.stages import chunks
    g = GPTShape(layers=96, hidden=18432, heads=96, kv_heads=8, ffn=73728, seq=4096, vocab=256000, gated=False,
                 bias=False, tied=False, learned_pos=False)
    assert split(g, 12) == (8,) * 10 + (9, 7)   # 1F1B keeps the balanced split
    m, c, t = gpt_stats(g), make_cluster("h100-sxm", 8, 96 * 8 // 8, inter="ib-ndr", nics_per_node=8), \
        Training(global_batch=96 * 8, efficiency=0.5)
    for pp, v in ((12, 8), (8, 12)):
        s = Strategy(dp=768 // (8 * pp), tp=8, pp=pp, micro_batch=1, schedule="interleaved", virtual=v)
        validate(m, c, t, s)
        p = evaluate(m, c, t, s)
        assert p.stage_layers == (96 // pp,) * pp and chunks(g, pp, v) == ((1,) * v,) * pp
        assert "Megatron's even split" in " ".join(explain(p))
    assert split(g, 16, None, 5) == (6,) * 14 + (7, 5)   # 80 chunks: balanced, each stage >= 5
    s = Strategy(dp=8, tp=8, pp=12, micro_batch=1, schedule="interleaved", virtual=9)
    with pytest.raises(ConfigError, match=r"96 layers cannot fill 12 stages x 9 interleaved chunks") as e:
        validate(m, c, t, s)
    assert e.value.field == "virtual" and "--virtual 8 or less" in str(e.value)
