"""NCCL's algorithm x protocol choice, as its tuner makes it: every (algorithm, protocol) pair that can run
a call gets a predicted time, the fastest wins (NCCL src/graph/tuning.cc; the tables below are its shape,
the per-hop latencies scaled to each link preset's alpha).

Protocols (how a GPU hands data to the next; NCCL docs, "Environment Variables: NCCL_PROTO"):

    LL      8-byte stores, 4 B of data + a 4 B flag: half the link's rate, the lowest latency per hop
    LL128   128-byte lines, 120 B of data + 8 B of flags: 120/128 of the rate, low latency (needs NVLink
            or a network whose writes arrive in order; NCCL enables it on NVLink and InfiniBand)
    Simple  bulk copies with a fence per chunk: the full rate, the highest latency per hop

Per call: time = base(algorithm, protocol) + hops x hop(link, protocol) + bytes on the busiest link /
(rate x protocol share). base and the hop ratios are NCCL's baseLat and hwLat tables (tuning.cc,
2.18-2.23): ring base LL 6.6 us, LL128 14 us, Simple 8.4 us; tree 6.8 / 14 / 0 us; a hop on NVLink
costs LL 0.6, LL128 1.9, Simple 3.4 us for a ring, on the network 2.7 / 4.0 / 14 us. tandem keeps its
link presets' alpha as the Simple hop and scales LL and LL128 by NCCL's ratios, so a slow network
stays slow.

Algorithms:

    ring    every collective; 2(n-1) steps for an all-reduce, n-1 for all-gather / reduce-scatter
    tree    all-reduce across nodes: double binary tree, log2(nodes) network hops, 0.92 of the rate
    nvls    all-reduce inside one node whose NVSwitch reduces in the switch (NVLink SHARP: NVLink 4/5,
            H100/H200/B200 HGX, GB200 NVL72), > 2 GPUs: each GPU sends its S once and reads the result
            once, S / (line rate x NVLS_SHARE) instead of 2(n-1)/n x S / rate; Simple only, 25 us a call
            (tuning.cc's NVLS hwLat on NVLink)
    pat     all-gather / reduce-scatter with one GPU per node (NCCL 2.23+ "PAT", parallel aggregated
            trees): the ring's bytes, log2(n) network hops instead of n-1; Simple only

NVLS_SHARE: NVIDIA's published NVLink SHARP figure for 8 H100s, a peak busbw of ~480 GB/s, algbw ~275 GB/s
(S. Jeaugey, nccl-tests issue #212): 275 / 450 = 0.61 of the NVLink 4 line rate, applied to the line rate of
NVLink 5 too. Ring, tree and PAT move their bytes at each link preset's achievable rate (nccl-tests busbw,
hardware.Link.rate_Bps; the line rate where none is published). A
`tandem bench comm` calibration replaces all of this with the measured alpha and bus bandwidth (the
planner keeps the ring then: the measurement already holds the library's choice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

PROTO_SHARE = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
BASE_US = {("ring", "LL"): 6.6, ("ring", "LL128"): 14.0, ("ring", "Simple"): 8.4,
           ("tree", "LL"): 6.8, ("tree", "LL128"): 14.0, ("tree", "Simple"): 0.0,
           ("nvls", "Simple"): 0.0, ("pat", "Simple"): 8.4}
# hop latency of LL / LL128 as a share of Simple's (NCCL hwLat, ring: NVLink .6/1.9/3.4, PCI 1.0/2.5/5.7,
# network 2.7/4.0/14; tree: NVLink .6/1.25/4, network 5.0/8.5/14)
HOP_SHARE = {("ring", "nvlink"): {"LL": .6 / 3.4, "LL128": 1.9 / 3.4}, ("ring", "pci"): {"LL": 1 / 5.7, "LL128": 2.5 / 5.7},
             ("ring", "net"): {"LL": 2.7 / 14, "LL128": 4 / 14}, ("tree", "nvlink"): {"LL": .6 / 4, "LL128": 1.25 / 4},
             ("tree", "pci"): {"LL": 1 / 4, "LL128": 1.9 / 4}, ("tree", "net"): {"LL": 5 / 14, "LL128": 8.5 / 14}}
NVLS_US = 25.0
NVLS_SHARE = 275 / 450   # algbw over the NVLink 4 line rate (nccl-tests #212)
NVLS_LINKS = ("nvlink4", "nvlink5")
TREE_SHARE = 0.92


@dataclass(frozen=True)
class Choice:
    time_s: float
    algorithm: str
    protocol: str


def hw_kind(link_name: str) -> str:
    n = link_name.lower()
    return "nvlink" if n.startswith(("nvlink", "xgmi")) else "pci" if n.startswith("pcie") else "net"


def _ll128_ok(link_name: str) -> bool:
    """NCCL turns LL128 on where stores arrive in order: NVLink (and Infinity Fabric here), InfiniBand."""
    n = link_name.lower()
    return n.startswith(("nvlink", "xgmi", "ib-"))


def hop_latency(alpha: float, algo: str, hw: str, proto: str) -> float:
    return alpha if proto == "Simple" else alpha * HOP_SHARE[(algo, hw)][proto]


def _protos(*links: str) -> list[str]:
    return ["LL", "Simple"] + (["LL128"] if all(_ll128_ok(x) for x in links) else [])


def ring(factor: float, nbytes: float, g, c, proto: str) -> float:
    """Hierarchical ring (collectives.ring_time's arithmetic) at the protocol's share of each link's rate."""
    share = PROTO_SHARE[proto]
    t = BASE_US[("ring", proto)] * 1e-6
    if g.nodes == 1:
        n = g.size
        return t + factor * (n - 1) / n * nbytes / (c.intra.rate_Bps * share) + \
            factor * (n - 1) * hop_latency(c.intra.latency_s, "ring", hw_kind(c.intra.name), proto)
    l, nn = g.local, g.nodes
    if l > 1:
        t += factor * (l - 1) / l * nbytes / (c.intra.rate_Bps * share) + \
            factor * (l - 1) * hop_latency(c.intra.latency_s, "ring", hw_kind(c.intra.name), proto)
    net = c.node_rate_Bps / c.gpus_per_node * share
    return t + factor * (nn - 1) / nn * (nbytes / l) / net + factor * (nn - 1) * hop_latency(c.inter.latency_s, "ring",
                                                                                       "net", proto)


def tree(nbytes: float, g, c, proto: str) -> float:
    """Double binary tree across nodes, a chain inside each (as collectives.tree_all_reduce)."""
    share = PROTO_SHARE[proto]
    l, nn = g.local, g.nodes
    t = BASE_US[("tree", proto)] * 1e-6 + 2 * nbytes / l / (TREE_SHARE * share * c.node_rate_Bps / c.gpus_per_node)
    if l > 1:
        t += 2 * (l - 1) / l * nbytes / (c.intra.rate_Bps * share)
    return t + 2 * ((l - 1) * hop_latency(c.intra.latency_s, "tree", hw_kind(c.intra.name), proto)
                    + math.ceil(math.log2(nn)) * hop_latency(c.inter.latency_s, "tree", "net", proto))


def nvls(nbytes: float, c) -> float:
    return NVLS_US * 1e-6 + nbytes / (c.intra.bandwidth_Bps * NVLS_SHARE)


def pat(nbytes: float, g, c) -> float:
    nn = g.nodes
    return (BASE_US[("pat", "Simple")] * 1e-6 + (nn - 1) / nn * nbytes / (c.node_rate_Bps / c.gpus_per_node)
            + math.ceil(math.log2(nn)) * c.inter.latency_s)


def candidates(kind: str, nbytes: float, g, c) -> list[Choice]:
    """Every (algorithm, protocol) NCCL could run this call with, and its predicted time."""
    factor = 2.0 if kind == "all_reduce" else 1.0
    links = (c.intra.name,) if g.nodes == 1 else ((c.inter.name,) if g.local == 1 else (c.intra.name, c.inter.name))
    out = [Choice(ring(factor, nbytes, g, c, p), "ring", p) for p in _protos(*links)]
    if kind == "all_reduce" and g.nodes > 1:
        out += [Choice(tree(nbytes, g, c, p), "tree", p) for p in _protos(*links)]
    if kind == "all_reduce" and g.nodes == 1 and g.size > 2 and c.intra.name in NVLS_LINKS:
        out.append(Choice(nvls(nbytes, c), "nvls", "Simple"))
    if kind in ("all_gather", "reduce_scatter") and g.nodes > 2 and g.local == 1:
        out.append(Choice(pat(nbytes, g, c), "pat", "Simple"))
    return out


@dataclass(frozen=True)
class _Net:
    """What the tuner reads of a cluster, hashable: the search asks the same questions thousands of times."""
    intra: object
    inter: object
    gpus_per_node: int
    node_rate_Bps: float


@lru_cache(maxsize=1 << 16)   # keyed on the fields, not a _Net: a hit then builds nothing
def _choose(kind: str, nbytes: float, g, intra, inter, gpus_per_node: int, node_rate_Bps: float) -> Choice:
    net = _Net(intra, inter, gpus_per_node, node_rate_Bps)
    return min(candidates(kind, nbytes, g, net), key=lambda x: x.time_s)


def choose(kind: str, nbytes: float, g, c) -> Choice:
    return _choose(kind, nbytes, g, c.intra, c.inter, c.gpus_per_node, c.node_rate_Bps)
