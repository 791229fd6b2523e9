"""Collective times: ring algorithms with nccl-tests bus-bandwidth factors, hierarchical across nodes.

A group of ``n`` ranks is laid out with ``local`` members on each of ``nodes`` nodes.

- One node: ring all-reduce moves 2(n-1)/n x S bytes through each GPU's link
  (all-gather and reduce-scatter (n-1)/n x S); time = factor x S / B_intra +
  steps x alpha. The factor is nccl-tests' "bus bandwidth" factor, so a measured
  busbw plugs straight in; B is each link preset's achievable busbw as nccl-tests
  publishes it (``Link.rate_Bps``), the line rate where no figure is published.
- Several nodes (hierarchical, as NCCL's tree/CollNet or a 2D ring): reduce-scatter
  inside the node, all-reduce of each GPU's 1/local shard across nodes, all-gather
  inside the node. Every GPU of a node talks to the network at the same time, so each
  gets B_node / gpus_per_node, where B_node is all NICs of a node together. The
  inter-node part is 2(N-1)/N x S / B_node no matter how many GPUs share the node:
  for the reference case's 2 nodes (ResNet-50's 102.4 MB of gradients over RoCE 25 Gb/s)
  that is exactly S / B_node = 102.4 MB / 3.125 GB/s = 33 ms.
- Algorithm choice (``collective``): as NCCL's tuner, each call takes the algorithm its
  model predicts fastest. An all-reduce across nodes may run as a double binary tree: its
  latency grows with log2(nodes) instead of 2(nodes-1) ring steps, at 0.92 of the ring's
  bus bandwidth and 2 x S / B instead of 2(N-1)/N x S / B (NCCL src/graph/tuning.cc: tree
  bandwidth x 0.92, algorithm bandwidth = bus bandwidth x 0.5). All-gather and
  reduce-scatter are rings. Measured (calibrated) links keep the ring: their alpha and
  bus bandwidth already hold whatever algorithm the library chose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from tandem.plan.inputs.hardware import Cluster
from tandem.plan.terms.nccl_algos import choose


@dataclass(frozen=True)
class Group:
    size: int
    local: int      # members on one node
    nodes: int      # nodes the group spans

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


# One collective (or p2p) of a step, as a term builds it: what it moves, over which group, and how much of it
# compute hides.
@dataclass
class CommOp:
    name: str
    collective: str
    bytes: float          # bytes each GPU contributes per call
    calls: int            # calls per step
    group: Group
    link: str
    time_s: float         # all calls of one step
    exposed_s: float
    chunks: int = 1       # framework calls per logical call (DDP buckets, FSDP blocks)
    algorithm: str = "ring"
    rule: str = "none"    # what hides it: buckets | prefetch | fsdp | manual | tp-bulk | tp-ring | pp-async | none
    window_s: float = 0.0 # compute it can hide behind, per logical call
    detail: tuple = ()    # fsdp: (blocks, gather, scatter, block fwd, block bwd, root gather, root scatter) s


@lru_cache(maxsize=4096)   # pure, a frozen Group: the cost model lays out several groups per candidate
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
    return c.node_rate_Bps / c.gpus_per_node


def ring_time(factor: float, nbytes: float, g: Group, c: Cluster, calls: int = 1) -> float:
    """``factor`` is 2 for all-reduce, 1 for all-gather / reduce-scatter (times (n-1)/n per phase)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    if g.nodes == 1:
        n = g.size
        return factor * (n - 1) / n * nbytes / c.intra.rate_Bps + calls * factor * (n - 1) * c.intra.latency_s
    t = 0.0
    l, nn = g.local, g.nodes
    if l > 1:  # reduce-scatter (and all-gather) inside the node
        t += factor * (l - 1) / l * nbytes / c.intra.rate_Bps + calls * factor * (l - 1) * c.intra.latency_s
    t += factor * (nn - 1) / nn * (nbytes / l) / _per_gpu_net(c) + calls * factor * (nn - 1) * c.inter.latency_s
    return t


def all_reduce(nbytes: float, g: Group, c: Cluster, calls: int = 1) -> float:
    return ring_time(2.0, nbytes, g, c, calls)


def all_gather(nbytes: float, g: Group, c: Cluster, calls: int = 1) -> float:
    """``nbytes`` is the size of the gathered (full) buffer; reduce-scatter costs the same."""
    return ring_time(1.0, nbytes, g, c, calls)


reduce_scatter = all_gather


TREE_BW = 0.92  # NCCL's tree all-reduce runs at 0.92 of the ring's bus bandwidth (src/graph/tuning.cc)


def tree_all_reduce(nbytes: float, g: Group, c: Cluster) -> float:
    """One double-binary-tree all-reduce across nodes (chain inside the node): reduce up the tree and
    broadcast down, 2 x S / l per GPU through the network at 0.92 of the ring's rate; latency
    2 x ((l-1) intra hops + ceil(log2 N) inter hops)."""
    l, nn = g.local, g.nodes
    t = 2 * nbytes / l / (TREE_BW * _per_gpu_net(c))
    if l > 1:
        t += 2 * (l - 1) / l * nbytes / c.intra.rate_Bps
    return t + 2 * ((l - 1) * c.intra.latency_s + math.ceil(math.log2(nn)) * c.inter.latency_s)


def measured(c: Cluster) -> bool:
    return c.inter.name.endswith("(measured)")   # the network was measured: its alpha holds the algorithm


def collective(kind: str, nbytes: float, chunks: int, g: Group, c: Cluster) -> tuple[float, str]:
    """Time of ``nbytes`` moved as ``chunks`` equal calls (DDP buckets, FSDP blocks), and the algorithm
    chosen per call: on datasheet links NCCL's tuner (nccl_algos.py: ring, tree, nvls or pat, and the
    protocol when not Simple, e.g. "ring/LL128"); on measured links "ring" or "tree" (all-reduce across
    nodes only, when the tree is faster)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0, "none"
    chunks = max(1, chunks)
    per = nbytes / chunks
    if not (measured(c) or c.intra.name.endswith("(measured)")):
        # datasheet links: NCCL's tuner, algorithm x protocol (nccl_algos.py)
        ch = choose(kind, per, g, c)
        return chunks * ch.time_s, ch.algorithm if ch.protocol == "Simple" else f"{ch.algorithm}/{ch.protocol}"
    factor = 2.0 if kind == "all_reduce" else 1.0
    ring = ring_time(factor, per, g, c)
    if kind == "all_reduce" and g.nodes > 1 and not measured(c):
        tree = tree_all_reduce(per, g, c)
        if tree < ring:
            return chunks * tree, "tree"
    return chunks * ring, "ring"


# Megatron-LM's distributed optimizer (ZeRO-1/2 here) accumulates and reduce-scatters BF16 gradients in FP32:
# "bfloat16 requires gradient accumulation and all-reduce to be done in fp32" (megatron/training/arguments.py:
# accumulate_allreduce_grads_in_fp32 is forced on for --bf16 unless --grad-reduce-in-bf16); Llama 3's training
# likewise "reduce-scatter[s] gradients in FP32" (Llama 3 paper, section 3.3.4). FP8 keeps 2 bytes: NVIDIA's FP8
# performance recipes reduce in BF16 (NeMo: "reduction in bf16 ensures improved performance at large scale
# training compared to the default precision of fp32", grad_sync_dtype=bf16 in its FP8 configs). FP16 keeps FP16
# (Megatron's flag is off for it), as do DDP and FSDP here (their reduce dtype is the model's).
FP32_GRAD_REDUCE = ("bf16",)


def grad_reduce_bytes(precision: str, zero: int, grad_bytes: int, override: str | None = None) -> int:
    """Bytes per gradient element the data-parallel reduction moves: ``override`` (--grad-reduce) if given, else
    FP32 for BF16 training at ZeRO-1/2 (Megatron's distributed optimizer), else the stored gradient's."""
    if override:
        return 4 if override == "fp32" else 2
    return 4 if zero in (1, 2) and precision in FP32_GRAD_REDUCE else grad_bytes


def p2p(nbytes: float, crosses_nodes: bool, c: Cluster) -> float:
    if crosses_nodes:
        return nbytes / _per_gpu_net(c) + c.inter.latency_s
    return nbytes / c.intra.rate_Bps + c.intra.latency_s
