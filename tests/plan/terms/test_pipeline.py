"""pipeline.py's once-a-step and fill terms: the tied embedding's gradient all-reduce between the first and
last pipeline stage (Megatron-LM's allreduce_word_embedding_grads) and the tensor-parallel communication the
pipeline's fill and drain repeat, with the explain[] line's arithmetic."""

import re

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.explain_compute import pipeline_line
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training

G = GPTShape(layers=96, hidden=12288, heads=128, seq=2048, vocab=64000)   # MegaScale's 175B (its §6.1)


def plan(pp=8, tp=8, tied=True, batch=768):
    g = GPTShape(**{**G.__dict__, "tied": tied})
    c = make_cluster("a100-80gb", 8, 32, inter="roce-200", nics_per_node=8)
    t = Training(global_batch=batch, precision="bf16", optimizer="adam", overlap=0.0, attention_kernel="fa2")
    s = Strategy(dp=256 // (tp * pp), tp=tp, pp=pp, zero=1, micro_batch=1,
                 schedule="interleaved" if pp > 1 else "1f1b", virtual=6, ranks_per_node=8)
    return evaluate(gpt_stats(g, "g"), c, t, s)


def test_embedding_gradient_all_reduced_between_first_and_last_stage():
    ops = {o.name: o for o in plan().comm}
    e = ops["embedding-grad"]
    assert e.bytes == 64000 * 12288 / 8 * 4          # V x h / tp, FP32 as Megatron's main_grad under BF16
    assert (e.calls, e.group.size, e.group.nodes) == (1, 2, 2) and e.exposed_s == e.time_s
    assert 0.010 < e.time_s < 0.025                  # 393 MB over one 200 Gb/s NIC each way
    assert "embedding-grad" not in {o.name for o in plan(tied=False).comm}   # Llama-style: two matrices
    assert "embedding-grad" not in {o.name for o in plan(pp=1, batch=1024).comm}   # one stage holds both


def test_fill_and_drain_repeat_the_tp_communication():
    p = plan()
    tp = next(o for o in p.comm if o.name == "tp-activations")
    mean_compute = (p.compute_s - p.optimizer_s - p.fsdp_copy_s) / p.stage_imbalance
    tp_mean = tp.exposed_s * (96 / 8) / max(p.stage_layers)
    # the bubble is fill x (a mean-stage micro-batch's compute + its tp all-reduces)
    assert p.bubble_comm_s / (p.bubble_s - p.bubble_comm_s) == pytest.approx(tp_mean / mean_compute, rel=1e-9)
    line = pipeline_line(p)
    fill, comm_mb, comm = re.search(r"communication, ([\d.]+) x ([\d.]+) ms = ([\d.]+) ms", line).groups()
    assert float(fill) * float(comm_mb) == pytest.approx(float(comm), rel=0.01)
    assert float(comm) == pytest.approx(p.bubble_comm_s * 1e3, rel=0.01)
    assert plan(tp=1).bubble_comm_s == 0.0 and plan(tp=1).bubble_s > 0   # no tp: nothing to repeat
