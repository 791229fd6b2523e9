"""Collective times: ring algorithms with nccl-tests bus-bandwidth factors, hierarchical across nodes.

A group of ``n`` ranks is laid out with ``local`` members on each of ``nodes`` nodes.

- One node: ring all-reduce moves 2(n-1)/n x S bytes through each GPU's link
  (all-gather and reduce-scatter (n-1)/n x S); time = factor x S / B_intra +
  steps x alpha. The factor is nccl-tests' "bus bandwidth" factor, so a measured
  busbw plugs straight in.
- Several nodes (hierarchical, as NCCL's tree/CollNet or a 2D ring): reduce-scatter
  inside the node, all-reduce of each GPU's 1/local shard across nodes, all-gather
  inside the node. Every GPU of a node talks to the network at the same time, so each
  gets B_node / gpus_per_node, where B_node is all NICs of a node together. The
  inter-node part is 2(N-1)/N x S / B_node no matter how many GPUs share the node:
  for the seed's 2 nodes that is exactly S / B_node = 102.4 MB / 3.125 GB/s = 33 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.plan.hardware import Cluster


@dataclass(frozen=True)
class Group:
    size: int
    local: int      # members on one node
    nodes: int      # nodes the group spans

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def layout(size: int, stride: int, gpus_per_node: int) -> Group:
    """Members are ranks r0, r0+stride, ...; ranks fill nodes in order (tp innermost, then dp, then pp
    as Megatron-LM orders them)."""
    if size <= 1:
        return Group(1, 1, 1)
    if stride >= gpus_per_node:
        return Group(size, 1, size)
    local = max(1, min(size, gpus_per_node // stride))
    return Group(size, local, -(-size // local))


def link_name(g: Group, c: Cluster) -> str:
    if g.size <= 1:
        return "none"
    if g.nodes == 1:
        return c.intra.name
    return c.inter.name if g.local == 1 else f"{c.intra.name}+{c.inter.name}"


def _per_gpu_net(c: Cluster) -> float:
    return c.node_bandwidth_Bps / c.gpus_per_node


def ring_time(factor: float, nbytes: float, g: Group, c: Cluster, calls: int = 1) -> float:
    """``factor`` is 2 for all-reduce, 1 for all-gather / reduce-scatter (times (n-1)/n per phase)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    if g.nodes == 1:
        n = g.size
        return factor * (n - 1) / n * nbytes / c.intra.bandwidth_Bps + calls * factor * (n - 1) * c.intra.latency_s
    t = 0.0
    l, nn = g.local, g.nodes
    if l > 1:  # reduce-scatter (and all-gather) inside the node
        t += factor * (l - 1) / l * nbytes / c.intra.bandwidth_Bps + calls * factor * (l - 1) * c.intra.latency_s
    t += factor * (nn - 1) / nn * (nbytes / l) / _per_gpu_net(c) + calls * factor * (nn - 1) * c.inter.latency_s
    return t


def all_reduce(nbytes: float, g: Group, c: Cluster, calls: int = 1) -> float:
    return ring_time(2.0, nbytes, g, c, calls)


def all_gather(nbytes: float, g: Group, c: Cluster, calls: int = 1) -> float:
    """``nbytes`` is the size of the gathered (full) buffer; reduce-scatter costs the same."""
    return ring_time(1.0, nbytes, g, c, calls)


reduce_scatter = all_gather


def p2p(nbytes: float, crosses_nodes: bool, c: Cluster) -> float:
    if crosses_nodes:
        return nbytes / _per_gpu_net(c) + c.inter.latency_s
    return nbytes / c.intra.bandwidth_Bps + c.intra.latency_s


def describe(g: Group, c: Cluster) -> str:
    if g.nodes == 1:
        return f"ring over {g.size} GPUs on {c.intra.name} ({c.intra.bandwidth_Bps / 1e9:.3g} GB/s per GPU)"
    net = f"{c.inter.name} ({c.node_bandwidth_Bps / 1e9:.4g} GB/s per node)"
    if g.local == 1:
        return f"ring across {g.nodes} nodes on {net}"
    return (f"hierarchical: {g.local} GPUs per node on {c.intra.name}, then {g.nodes} nodes on {net}")
