"""NCCL's algorithm x protocol choice (tandem/plan/terms/nccl_algos.py), against hand-computed numbers from NCCL's
tuning tables (src/graph/tuning.cc baseLat/hwLat, 2.18-2.23) and the protocols' payload shares (NCCL_PROTO)."""

import math

import pytest

from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.terms import nccl_algos as NA
from tandem.plan.terms.collectives import collective, layout


def test_protocol_shares():
    assert NA.PROTO_SHARE == {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}


def test_small_all_reduce_inside_a_node_goes_ll_at_nccl_tests_latency():
    """8 KB on 8 H100s: LL's 6.6 us base + 14 hops x 3 us x 0.6/3.4, not the old 14 x 3 us = 42 us; the bytes at
    half of NVLink 4's achievable 370 GB/s."""
    c = make_cluster("h100-sxm", 8, 1)
    g = layout(8, 1, 8)
    ch = NA.choose("all_reduce", 8192, g, c)
    want = 6.6e-6 + 2 * 7 / 8 * 8192 / (370e9 * 0.5) + 14 * 3e-6 * 0.6 / 3.4
    assert (ch.algorithm, ch.protocol) == ("ring", "LL") and ch.time_s == pytest.approx(want)
    assert 10e-6 < ch.time_s < 20e-6
    assert collective("all_reduce", 8192, 1, g, c) == (pytest.approx(want), "ring/LL")


def test_large_all_reduce_on_nvswitch_uses_nvls_where_the_switch_reduces():
    h100, a100 = make_cluster("h100-sxm", 8, 1), make_cluster("a100-80gb", 8, 1)
    g = layout(8, 1, 8)
    S = 1 << 30
    ch = NA.choose("all_reduce", S, g, h100)
    # NVIDIA's published 8 x H100 figures (nccl-tests #212): NVLS algbw ~275 GB/s (busbw ~480), ring busbw 370
    assert ch.algorithm == "nvls" and ch.time_s == pytest.approx(25e-6 + S / 275e9)
    ring = NA.ring(2.0, S, g, h100, "Simple")
    assert 2 * 7 / 8 * S / ring == pytest.approx(370e9, rel=0.01)
    assert 2 * 7 / 8 * S / ch.time_s == pytest.approx(480e9, rel=0.01)
    assert NA.choose("all_reduce", S, g, a100).algorithm == "ring"        # NVLink 3 switches do not reduce
    assert NA.choose("all_reduce", S, layout(2, 1, 8), h100).algorithm == "ring"   # 2 GPUs: no NVLS
    b200 = make_cluster("b200", 8, 1)
    assert collective("all_reduce", S, 1, g, b200)[1] == "nvls"


def test_pat_for_all_gather_with_one_gpu_per_node():
    """64 nodes x 1 GPU, 64 KB: PAT's log2(64) = 6 network hops beat the ring's 63."""
    c = make_cluster("h100-sxm", 1, 64, inter="ib-ndr")
    g = layout(64, 1, 1)
    ch = NA.choose("all_gather", 65536, g, c)
    want = 8.4e-6 + 63 / 64 * 65536 / 48e9 + 6 * 5e-6
    assert ch.algorithm == "pat" and ch.time_s == pytest.approx(want)
    # with 8 GPUs a node NCCL 2.23 has no PAT: a ring
    assert NA.choose("all_gather", 65536, layout(512, 1, 8), make_cluster("h100-sxm", 8, 64)).algorithm == "ring"


def test_ll128_only_where_stores_arrive_in_order():
    eth = make_cluster("a100-80gb", 8, 4, inter="eth-100")
    protos = {x.protocol for x in NA.candidates("all_reduce", 1 << 20, layout(32, 1, 8), eth)}
    assert protos == {"LL", "Simple"}
    ib = make_cluster("a100-80gb", 8, 4, inter="ib-hdr")
    assert "LL128" in {x.protocol for x in NA.candidates("all_reduce", 1 << 20, layout(32, 1, 8), ib)}


def test_tree_latency_grows_with_log2_nodes():
    c = make_cluster("h100-sxm", 8, 1024, inter="ib-ndr", nics_per_node=8)
    g = layout(8192, 1, 8)
    t = NA.tree(0.0, g, c, "Simple")
    assert t == pytest.approx(2 * (7 * 3e-6 + math.ceil(math.log2(1024)) * 5e-6))


def test_a_calibrated_link_keeps_the_measured_ring():
    from dataclasses import replace

    c = make_cluster("h100-sxm", 8, 1)
    c = replace(c, intra=replace(c.intra, name="loopback (measured)"))
    assert collective("all_reduce", 1 << 30, 1, layout(8, 1, 8), c)[1] == "ring"
