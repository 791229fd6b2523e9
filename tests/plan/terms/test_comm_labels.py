"""The algorithm a comm entry names is the one its time was computed with (issue 29: tp-activations said "ring" while
charging NVLS's 25 us + S / (0.61 x 450 GB/s))."""

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import preset
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms import nccl_algos as NA
from tandem.plan.terms.fsdp_copies import units as fsdp_units
from tandem.plan.terms.params import stage_psi

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def named(o, c, nbytes: float) -> float:
    """One call of ``nbytes`` by the (algorithm, protocol) the entry names (nccl_algos.candidates)."""
    algo, _, proto = o.algorithm.partition("/")
    hits = [x for x in NA.candidates(o.collective, nbytes, o.group, c)
            if (x.algorithm, x.protocol) == (algo, proto or "Simple")]
    assert hits, (o.name, o.algorithm)
    return hits[0].time_s


CASES = [   # (model, cluster, strategy): NVLS inside a node, tree/ring across nodes, PAT, FSDP, a tied pipeline
    ("llama2-7b", ("h100-sxm", 8, 1), dict(dp=1, tp=8, micro_batch=1)),
    ("llama2-70b", ("h100-sxm", 8, 8, "ib-ndr", 8), dict(dp=16, tp=4, zero=3, micro_batch=1, recompute="full")),
    ("gpt3-175b", ("a100-80gb", 8, 16, "ib-hdr", 8), dict(dp=4, tp=8, pp=4, zero=1, micro_batch=1)),
    ("llama3-8b", ("h100-sxm", 8, 4, "ib-ndr", 8), dict(dp=32, zero=0, micro_batch=1, recompute="full")),
    ("llama3-8b", ("h100-sxm", 8, 32, "ib-ndr", 8), dict(dp=32, tp=8, zero=3, micro_batch=1)),
]


@pytest.mark.parametrize("name, cl, st", CASES)
def test_every_comm_entry_is_timed_by_the_algorithm_it_names(name, cl, st):
    m, c = preset(name), make_cluster(*cl[:3], inter=cl[3] if len(cl) > 3 else "ib-hdr",
                                       nics_per_node=cl[4] if len(cl) > 4 else 1)
    s = Strategy(**st, ranks_per_node=c.gpus_per_node)
    p = evaluate(m, c, Training(global_batch=256, flash_attention=True), s)
    seen = set()
    for o in p.comm:
        if o.collective not in COLLECTIVES:
            assert o.algorithm in ("p2p", "pairwise"), (o.name, o.algorithm)
            continue
        seen.add(o.algorithm)
        if o.name in ("fsdp-params", "dp-grad") and o.rule == "fsdp":   # per block: detail (units, a, r, ...)
            units, root = fsdp_units(m, s, stage_psi(m, s))
            block = (stage_psi(m, s) - root) / units
            per_elem = o.bytes / stage_psi(m, s)
            got = o.detail[1] if o.collective == "all_gather" else None
            if got is not None:
                assert got == pytest.approx(named(o, c, block * per_elem)), o.name
            continue
        assert o.time_s == pytest.approx(named(o, c, o.bytes / o.chunks) * o.chunks * o.calls), (o.name, o.algorithm)
    if name == "llama2-7b":   # 8 H100s on NVLink 4: the tensor-parallel all-reduce is NVLS, and says so
        tp = next(o for o in p.comm if o.name == "tp-activations")
        assert tp.algorithm == "nvls"
        assert tp.time_s / tp.calls == pytest.approx(NA.NVLS_US * 1e-6 + tp.bytes / (450e9 * NA.NVLS_SHARE))
    assert seen
