"""NCCL-style algorithm choice, framework bucket/unit sizes and overlap, against hand-computed numbers."""

import math

import pytest

from tandem.plan.explain import explain
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import preset
from tandem.plan.inputs.training import Strategy
from tandem.plan.terms import dp_overlap as O, nccl_algos as NA
from tandem.plan.terms.collectives import TREE_BW, Group, collective, layout

MiB = 1024**2


def test_tree_beats_ring_for_a_bucket_across_1250_nodes():
    # 10,000 H100s: 1,250 nodes x 8, 8 x NDR 400 (48 GB/s achievable each) per node, alpha 5 us (IB), 3 us
    # (NVLink at its achievable 370 GB/s).
    c = make_cluster("h100-sxm", 8, 1250, inter="ib-ndr", nics_per_node=8)
    g = layout(10_000, 1, 8)
    assert g == Group(10_000, 8, 1250)
    S = 25 * MiB
    intra_bw = 2 * 7 / 8 * S / 370e9
    ring = intra_bw + 2 * 7 * 3e-6 + 2 * 1249 / 1250 * (S / 8) / 48e9 + 2 * 1249 * 5e-6
    tree = intra_bw + 2 * (S / 8) / (0.92 * 48e9) + 2 * (7 * 3e-6 + math.ceil(math.log2(1250)) * 5e-6)
    assert ring == pytest.approx(12.79e-3, abs=0.01e-3)     # 2 x 1249 ring steps: 12.5 ms of latency
    assert tree == pytest.approx(0.424e-3, abs=0.001e-3)    # 11 tree levels
    assert NA.tree(S, g, c, "Simple") == pytest.approx(tree)   # NCCL's tree base latency with Simple is 0
    t, algo = collective("all_reduce", S, 1, g, c)
    # the tuner takes LL128 here: 94% of the rate, but 2 x (7 + 11) hops at 8.5/14 of Simple's latency
    # (and 14 us once) save more than the 6% of bandwidth costs at 3.3 MB per GPU
    assert algo == "tree/LL128" and t < tree and t == pytest.approx(NA.tree(S, g, c, "LL128"))
    # 400 buckets cost 400 x the per-call latency: the ring would take 5.1 s, the tree 0.16 s
    t400, algo = collective("all_reduce", 400 * S, 400, g, c)
    assert algo == "tree/LL128" and t400 == pytest.approx(400 * t)


def test_ring_stays_on_two_nodes_and_for_big_messages():
    c = make_cluster("a100-80gb", 2, 2, inter="roce-25")
    t, algo = collective("all_reduce", 102.4e6, 1, layout(4, 1, 2), c)
    assert algo == "ring"                     # tree: 2 x 51.2 MB / (0.92 x 1.5625 GB/s) = 71 ms > 33 ms (RoCE 25G at its line rate)
    assert TREE_BW == 0.92
    big = make_cluster("h100-sxm", 8, 16, inter="ib-ndr", nics_per_node=8)
    assert collective("all_reduce", 4e9, 1, layout(128, 1, 8), big)[1] == "ring"
    # all-gather and reduce-scatter with 8 GPUs a node are rings whatever the scale; 1 KB a GPU goes as LL
    assert collective("all_gather", 1e6, 1, layout(1024, 1, 8), make_cluster("h100-sxm", 8, 128))[1] == "ring/LL"
    assert collective("all_gather", 1e9, 1, layout(1024, 1, 8), make_cluster("h100-sxm", 8, 128))[1] == "ring"


def test_explain_says_which_algorithm():
    c = make_cluster("h100-sxm", 8, 1250, inter="ib-ndr", nics_per_node=8)
    from tandem.plan.inputs.training import Training
    from tandem.plan.cost import evaluate
    p = evaluate(preset("llama2-7b"), c, Training(global_batch=10_000), Strategy(dp=10_000, micro_batch=1))
    (op,) = p.comm
    assert op.algorithm.startswith("tree") and op.chunks == math.ceil(6_738_415_616 * 2 / (25 * MiB))   # 515 buckets
    text = " ".join(explain(p))
    assert "NCCL-style tree" in text and "in 515 buckets" in text


def test_bucket_overlap_formula():
    # k equal buckets ready evenly through window w: exposed = max(t/k, t - w (k-1)/k)
    assert O.pipelined(40.0, 4, 100.0) == 10.0             # last bucket only
    assert O.pipelined(100.0, 4, 40.0) == 70.0             # 100 - 40 x 3/4: the window is too short
    assert O.pipelined(10.0, 1, 1e9) == 10.0               # one bucket: ready when backward ends


def test_fsdp_formula_by_hand():
    # 4 blocks; one block's all-gather 2, reduce-scatter 1, forward 1, backward 2.5 (any unit):
    # forward: 2 + 3 x max(0, 2 - 1) = 5; backward gathers: 2 + 3 x max(0, 2 - 2.5) = 2;
    # backward reduce-scatters: 1 + 3 x (max(0, 2 + 1 - 2.5) - 0) = 2.5; root 0.5 + 0.25
    e = O.fsdp(4, 2.0, 1.0, 1.0, 2.5, root_gather_s=0.5, root_scatter_s=0.25)
    assert e.gather_s == pytest.approx(5 + 2 + 0.5)
    assert e.scatter_s == pytest.approx(2.5 + 0.25)


def test_fsdp_units_are_transformer_blocks(plan_of):
    c = make_cluster("a100-80gb", 8, 2)
    p = plan_of(preset("llama2-7b"), c, global_batch=64, strategy=Strategy(dp=16, zero=3, micro_batch=2,
                                                                            recompute="selective"))
    ag = next(o for o in p.comm if o.name == "fsdp-params")
    rs = next(o for o in p.comm if o.name == "dp-grad")
    assert ag.chunks == rs.chunks == 32 + 1           # 32 blocks + the root (embeddings, head)
    assert ag.rule == rs.rule == "fsdp"
    assert 0 < ag.exposed_s < ag.time_s and 0 < rs.exposed_s < rs.time_s
    manual = plan_of(preset("llama2-7b"), c, global_batch=64, overlap=0.0,
                     strategy=Strategy(dp=16, zero=3, micro_batch=2, recompute="selective"))
    assert manual.exposed_comm_s == pytest.approx(manual.comm_s)
    assert p.exposed_comm_s < manual.exposed_comm_s
    assert "per micro-batch, 32 blocks + root: forward a + (n-1) x max(0, a - f)" in " ".join(explain(p))


def test_zero1_param_gather_exposed_unless_megatron_overlaps_it(plan_of):
    c = make_cluster("a100-80gb", 8, 4)
    s = dict(strategy=Strategy(dp=32, zero=1, micro_batch=1, recompute="full"), global_batch=64)
    p = plan_of(preset("llama2-7b"), c, **s)
    ag = next(o for o in p.comm if o.name == "dp-params")
    assert ag.exposed_s == ag.time_s and ag.rule == "none"
    # Megatron buckets: max(40M, 1M x 32) = 40M params -> ceil(6,738M / 40M) = 169 buckets
    assert ag.chunks == 169
    q = plan_of(preset("llama2-7b"), c, overlap_param_gather=True, **s)
    ag2 = next(o for o in q.comm if o.name == "dp-params")
    assert ag2.rule == "prefetch" and ag2.exposed_s == pytest.approx(O.pipelined(ag2.time_s, 169, ag2.window_s))
    assert ag2.exposed_s < ag.exposed_s


@pytest.mark.parametrize("precision,zero,grad_bytes", [("bf16", 1, 4), ("bf16", 2, 4), ("fp8", 1, 2),
                                                       ("fp16", 1, 2), ("bf16", 0, 2), ("bf16", 3, 2)])
def test_megatron_reduce_scatters_bf16_gradients_in_fp32(plan_of, precision, zero, grad_bytes):
    # Megatron-LM's arguments.py forces accumulate_allreduce_grads_in_fp32 for --bf16 (ZeRO-1/2 here = its
    # distributed optimizer); FP8 recipes reduce in BF16 (NeMo grad_sync_dtype=bf16); DDP/FSDP in the model's dtype
    c = make_cluster("h100-sxm", 8, 4, inter="ib-ndr", nics_per_node=8)
    m = preset("llama2-7b")
    p = plan_of(m, c, global_batch=64, precision=precision, strategy=Strategy(dp=32, zero=zero, micro_batch=1))
    rs = next(o for o in p.comm if o.name == "dp-grad")
    assert rs.bytes == pytest.approx(m.params * grad_bytes)
    if zero in (1, 2):   # the all-gather of the updated parameters stays in the model's dtype
        assert next(o for o in p.comm if o.name == "dp-params").bytes == pytest.approx(m.params * 2)
    line = next(x for x in explain(p) if x.startswith("Gradients per GPU"))
    assert f"x {grad_bytes} B ({precision})" in line and ("in FP32" in line) == (grad_bytes == 4)


def test_grad_reduce_overrides_the_framework_default(plan_of):
    c = make_cluster("h100-sxm", 8, 4, inter="ib-ndr", nics_per_node=8)
    m = preset("llama2-7b")
    for zero, given, nbytes in [(1, "bf16", 2), (0, "fp32", 4), (3, "fp32", 4)]:
        p = plan_of(m, c, global_batch=64, grad_reduce=given, strategy=Strategy(dp=32, zero=zero, micro_batch=1))
        rs = next(o for o in p.comm if o.name == "dp-grad")
        assert rs.bytes == pytest.approx(m.params * nbytes)
        assert f"(--grad-reduce {given}; 2 B stored)" in " ".join(explain(p))
    with pytest.raises(Exception, match="grad-reduce"):
        plan_of(m, c, global_batch=64, grad_reduce="fp8")
