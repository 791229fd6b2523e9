"""The planner's pipeline terms against Megatron-LM's interleaved 1F1B as MegaScale's baseline ran it (commit
285068c8: each warm-up forward, 1F1B pair and cool-down backward followed by one blocking send/recv call;
tests/plan/megatron_schedule.py). Issue 14 asked whether those blocking warm-up/cool-down transfers are a per-step
cost the planner misses (MegaScale's "PP overlap", its Table 3): they are not. Without transfer time the schedule
takes exactly the planner's m x slowest stage + fill and drain (stages.fill_units), head on the last chunk or not;
each transfer adds less than the planner's 2 (m + p - 1) v exposed sends charge (0.90 of it at MegaScale's m = 192,
0.83 at 48, 0.60 at m = p): the blocking calls cost per micro-batch, not per step."""

import functools

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms import stages as ST
from tests.plan.megatron_schedule import step_time

F, B = 1.0, 2.0   # a chunk's forward and backward (one layer a chunk); only ratios matter


@pytest.mark.parametrize("p,v,m,head", [(4, 2, 4, 0.0), (4, 2, 8, 0.7), (4, 3, 12, 0.0), (8, 6, 16, 0.42),
                                        (8, 6, 48, 0.42)])
def test_fill_and_drain_match_megatron_schedule(p, v, m, head):
    chunks = tuple((1,) * v for _ in range(p))
    stage = [v * (F + B)] * p
    stage[-1] += 3 * head
    planned = m * max(stage) + ST.fill_units(chunks, F, B, head, 2 * head, m) * sum(stage) / p
    assert step_time(p, v, m, F, B, 0.0, head) == pytest.approx(planned, rel=1e-9)


@pytest.mark.parametrize("m,share", [(8, 0.55), (48, 0.8), (192, 0.85)])   # measured 0.60, 0.83, 0.90
def test_blocking_p2p_is_within_the_planners_charge(m, share):
    """MegaScale's 175B at 256 GPUs shape (p 8, v 6, 2 layers a chunk, its logits on the last): the planner's
    pp-p2p op (evaluate) against the transfers the blocking schedule puts on the critical path."""
    g = GPTShape(layers=96, hidden=12288, heads=128, seq=2048, vocab=64000)
    c = make_cluster("a100-80gb", 8, 32, inter="roce-200", nics_per_node=8)
    t = Training(global_batch=4 * m, precision="bf16", optimizer="adam", overlap=0.0, attention_kernel="fa2")
    s = Strategy(dp=4, tp=8, pp=8, zero=1, micro_batch=1, schedule="interleaved", virtual=6, ranks_per_node=8)
    op = next(o for o in evaluate(gpt_stats(g, "g"), c, t, s).comm if o.name == "pp-p2p")
    head = ST.head_cost(g) * F   # the logits' forward in units of a layer's (F a layer here)
    lf, lb = 2 * F, 2 * B         # two layers a chunk
    ct = 0.01
    sends = (step_time(8, 6, m, lf, lb, ct, head) - step_time(8, 6, m, lf, lb, 0.0, head)) / ct
    assert sends <= op.calls, (sends, op.calls)
    assert sends >= share * op.calls, (sends, op.calls)


@functools.lru_cache(maxsize=None)
def _no_transfer(p, v, m, overlap):   # the same schedule without transfer time (shared by the cases below)
    return step_time(p, v, m, F, B, 0.0, overlap=overlap)


@pytest.mark.parametrize("p,v", [(4, 2), (8, 6), (8, 12), (12, 8)])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("ct", [0.5, 1.5, 2.5])   # a send against a chunk's forward (F = 1, backward 2)
def test_overlapped_sends_match_megatron_core(p, v, k, ct):
    """Megatron-core's overlap_p2p_comm (df727128, the schedule MLPerf v3.1's NeMo GPT-3 runs): the sends left on
    the critical path are pipeline.p2p_exposed's, exactly while a send is no longer than a chunk's forward;
    longer, the closed form is an approximation, within 12% of it on this grid (m up to 4 p, a send up to 2.5 x a
    chunk's forward; it over-charges more as m grows: pipeline.py); m = k p micro-batches."""
    from tandem.plan.terms.pipeline import p2p_exposed

    m = k * p
    des = step_time(p, v, m, F, B, ct, overlap=True) - _no_transfer(p, v, m, True)
    planned = p2p_exposed(ct, p, v, m, F)
    assert des == pytest.approx(planned, rel=1e-9 if ct <= F else 0.12)
    assert des < step_time(p, v, m, F, B, ct) - _no_transfer(p, v, m, False)   # fewer than blocking


def test_overlap_changes_nothing_without_a_steady_state():
    """m = p: every chunk forward is warm-up, so async posts are waited at once: the blocking schedule's time, and
    its sends on the critical path are 2 (p v - 1) + 2 (p - 1) (the planner charges its bound, 2 (m + p - 1) v)."""
    for p, v in ((4, 2), (8, 12)):
        ct = 0.01
        blocking = step_time(p, v, p, F, B, ct) - step_time(p, v, p, F, B, 0.0)
        assert step_time(p, v, p, F, B, ct, overlap=True) == pytest.approx(step_time(p, v, p, F, B, ct))
        assert blocking / ct == pytest.approx(2 * (p * v - 1) + 2 * (p - 1))


def test_planner_charges_the_overlapped_sends():
    """evaluate with --overlap-p2p: the pp-p2p op keeps every send's time and exposes the fill and drain's
    2 (p v - 1) when the sends are shorter than a chunk (MLPerf v3.1's GPT-3 shape at 4,096 H100s, m = 16)."""
    g = GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=50688)
    c = make_cluster("h100-sxm", 8, 512, inter="ib-ndr", nics_per_node=8)
    s = Strategy(dp=128, tp=4, pp=8, zero=1, micro_batch=1, schedule="interleaved", virtual=12, ranks_per_node=8)
    ops = {}
    for overlap in (False, True):
        t = Training(global_batch=2048, precision="fp8", optimizer="adam", overlap_p2p=overlap)
        ops[overlap] = next(o for o in evaluate(gpt_stats(g, "g"), c, t, s).comm if o.name == "pp-p2p")
    off, on = ops[False], ops[True]
    one = off.time_s / off.calls
    assert on.time_s == off.time_s == off.exposed_s and off.rule == "none" and on.rule == "pp-async"
    assert one < on.window_s and on.exposed_s == pytest.approx(2 * (8 * 12 - 1) * one)
