"""Achievable (nccl-tests busbw) rates per link preset, against published nccl-tests figures.

Large messages: NVIDIA's own figures. 8 x H100 on NVLink 4: ring busbw 370 GB/s, NVLink SHARP peak busbw ~480
GB/s (algbw ~275) (S. Jeaugey, NVIDIA/nccl-tests issue #212); 8 x A100 SXM in one node: 232.5 GB/s busbw
(NVIDIA/nccl-tests issue #175, all_reduce_perf -b 8 -e 4G -g 8); InfiniBand HDR: 192 GB/s all-reduce busbw
on a DGX A100's 8 HDR NICs (NVIDIA, NVIDIA/nccl issue #812).
Small messages: an all_reduce_perf curve on 8 GPUs of one NVLink 4 (900 GB/s) HGX board (H20, the H100's
NVLink and switches; deepseek-ai/DeepEP issue #303, out-of-place column): 8 B in 12.49 us, 4 KB in 16.69 us.
The planner's H100 preset has the same NVLink; its LL protocol must land within 20% (before the LL/LL128
protocols and the per-hop latencies were modelled, 8 KB took 42 us of latency alone: the issue's "2x too slow").
"""

import pytest

from tandem.plan.inputs.hardware import LINKS, make_cluster
from tandem.plan.terms import nccl_algos as NA
from tandem.plan.terms.collectives import collective, layout

GiB = 1 << 30


def test_every_link_has_an_achievable_rate_with_its_source():
    for link in LINKS.values():
        assert 0 < link.rate_Bps <= link.bandwidth_Bps, link.name
        assert bool(link.busbw_Bps) == bool(link.busbw_source), link.name   # a figure always says where from
    assert LINKS["nvlink4"].rate_Bps == 370e9 and LINKS["ib-ndr"].rate_Bps == 48e9
    # the seed's links keep the line rate the seed reckons with (102.4 MB / 3.125 GB/s = 33 ms)
    assert LINKS["roce-25"].rate_Bps == 25e9 / 8 and LINKS["eth-10"].rate_Bps == 10e9 / 8


def _busbw(t: float, nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes / t      # nccl-tests' all-reduce bus bandwidth


def test_large_all_reduce_bus_bandwidth_as_published():
    h100 = make_cluster("h100-sxm", 8, 1)
    g = layout(8, 1, 8)
    assert _busbw(NA.ring(2.0, 4 * GiB, g, h100, "Simple"), 4 * GiB, 8) == pytest.approx(370e9, rel=0.01)
    t, algo = collective("all_reduce", 4 * GiB, 1, g, h100)
    assert algo == "nvls" and _busbw(t, 4 * GiB, 8) == pytest.approx(480e9, rel=0.02)
    a100 = make_cluster("a100-80gb", 8, 1)
    t, algo = collective("all_reduce", 4 * GiB, 1, g, a100)
    assert algo == "ring" and _busbw(t, 4 * GiB, 8) == pytest.approx(232.5e9, rel=0.01)
    # one GPU and one HDR NIC per node, 2 nodes: the ring's busbw is the NIC's achievable 24 GB/s (192 / 8)
    hdr = make_cluster("a100-80gb", 1, 2, inter="ib-hdr")
    t, algo = collective("all_reduce", 4 * GiB, 1, layout(2, 1, 1), hdr)
    assert algo == "ring" and _busbw(t, 4 * GiB, 2) == pytest.approx(24e9, rel=0.01)


@pytest.mark.parametrize("nbytes, published_us", [(8, 12.49), (4096, 16.69)])
def test_small_all_reduce_latency_as_published(nbytes, published_us):
    c = make_cluster("h100-sxm", 8, 1)
    t, algo = collective("all_reduce", nbytes, 1, layout(8, 1, 8), c)
    assert algo == "ring/LL"
    assert t * 1e6 == pytest.approx(published_us, rel=0.20)


def test_json_has_both_rates():
    from tandem.plan.inputs.training import Strategy, Training
    from tandem.plan.cost import evaluate
    from tandem.plan.inputs.model import preset
    from tandem.plan.report import to_dict

    c = make_cluster("h100-sxm", 8, 2, inter="ib-ndr", nics_per_node=8)
    d = to_dict(evaluate(preset("llama2-7b"), c, Training(global_batch=16), Strategy(dp=16, micro_batch=1)))["cluster"]
    assert d["intra_bandwidth_Bps"] == 450e9 and d["intra_busbw_Bps"] == 370e9
    assert d["node_bandwidth_Bps"] == 400e9 and d["node_busbw_Bps"] == 384e9
