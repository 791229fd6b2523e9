"""Expert parallelism (MoE) and context parallelism (ring attention): parameters, memory, communication.

Standalone arithmetic on a ``GPTShape`` (tandem/plan/model.py), not yet wired into ``evaluate`` and the
CLI: the planner's strategy vocabulary is being moved to ParallelDims, and cp/ep degrees join it there.

**MoE** (``MoEShape``): the MLP of each MoE layer is ``experts`` routed experts of inner size
``expert_ffn`` (gated like the base shape) plus ``shared`` always-active ones and a router (h x experts);
the first ``dense_layers`` layers keep the base shape's dense MLP. Each token runs ``top_k`` routed
experts and the shared ones, so the FLOPs follow the active parameters. ``attn_params`` overrides the
attention block's parameter count per layer (multi-head latent attention, DeepSeek-V2/V3).

Per GPU with expert parallelism ``ep`` (Megatron-core's layout: experts split over ep ranks carved out
of the data-parallel ranks; non-expert weights split by tp and pp as usual): expert weights / (ep x pp),
the rest / (tp x pp). Token routing is two all-to-alls in the forward (dispatch, combine) and two in the
backward per MoE layer per micro-batch, each carrying b x s/cp x top_k x capacity_factor x h values per
GPU, of which (ep-1)/ep leave it. An all-to-all's time: the bytes that cross the network at each GPU's
share of its node's NICs, the rest at the NVLink rate, plus ep-1 message latencies of the slowest link
(NCCL runs it as ep-1 point-to-point pairs).

**Context parallelism** (ring attention: Liu et al. 2023, "Ring Attention with Blockwise Transformers";
Megatron-core's ``context_parallel_size``): the sequence is split in ``cp`` chunks (load-balanced for
causal masks), each GPU holds s/cp tokens' activations (Korthikanti et al.'s per-layer formula at
s/cp). Per layer and micro-batch the K and V chunks go around the ring: cp-1 steps of
2 x b x s/cp x kv_dim values in the forward, twice that in the backward (K, V and their gradients),
each step hidden behind one block's attention (4 x b x (s/cp)^2 x h FLOPs forward, twice backward):
exposed = (cp-1) x max(0, send - block compute).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.plan.hardware import Cluster
from tandem.plan.model import GPTShape


@dataclass(frozen=True)
class MoEShape:
    base: GPTShape
    experts: int
    top_k: int
    expert_ffn: int
    shared: int = 0
    dense_layers: int = 0
    capacity_factor: float = 1.0
    attn_params: int | None = None     # per layer, when attention is not GPTShape's (MLA)

    @property
    def moe_layers(self) -> int:
        return self.base.layers - self.dense_layers


def mlp_params(g: GPTShape, ffn: int) -> int:
    return (3 if g.gated else 2) * g.hidden * ffn + (((2 if g.gated else 1) * ffn + g.hidden) if g.bias else 0)


def _attn_norm_params(m: MoEShape) -> int:
    g = m.base
    own = g.layer_params() - mlp_params(g, g.ffn)
    if m.attn_params is None:
        return own
    norms = 2 * (2 * g.hidden if g.norm == "layernorm" else g.hidden)
    return m.attn_params + norms


def _outside_layers(g: GPTShape) -> int:
    return g.params() - g.layers * g.layer_params()


def params(m: MoEShape, active: bool = False) -> int:
    """All parameters, or (active) those one token uses: top_k routed experts + the shared ones."""
    g = m.base
    routed = m.top_k if active else m.experts
    moe = (routed + m.shared) * mlp_params(g, m.expert_ffn) + g.hidden * m.experts
    return (g.layers * _attn_norm_params(m) + m.dense_layers * mlp_params(g, g.ffn) + m.moe_layers * moe
            + _outside_layers(g))


def expert_params(m: MoEShape) -> int:
    """Routed expert weights of the whole model: what expert parallelism splits."""
    return m.moe_layers * m.experts * mlp_params(m.base, m.expert_ffn)


def fwd_flops_per_token(m: MoEShape) -> float:
    """2 FLOPs per multiply-add of the weight matrices a token uses (attention projections, top_k + shared
    experts, the router), attention scores 4 s h per layer and the logits, as GPTShape counts a dense model
    (norms and biases left out)."""
    g = m.base
    attn = m.attn_params if m.attn_params is not None else g.hidden * (g.hidden + 2 * g.kv_dim) + g.hidden * g.hidden
    mats = (3 if g.gated else 2) * g.hidden
    per_moe = (m.top_k + m.shared) * mats * m.expert_ffn + g.hidden * m.experts
    total = g.layers * attn + m.dense_layers * mats * g.ffn + m.moe_layers * per_moe
    return 2 * total + 4 * g.seq * g.hidden * g.layers + g.logits_fwd_flops_per_token()


def states_per_gpu(m: MoEShape, tp: int, pp: int, ep: int, dp: int, zero: int, by: dict, optimizer_bytes: int) -> dict:
    """Model-state bytes per GPU: expert weights / (ep x pp), sharded further over the expert-data-parallel
    group (dp / ep) by ZeRO; everything else / (tp x pp), sharded over dp."""
    if dp % ep:
        raise ValueError(f"ep {ep} must divide dp {dp}")
    e = expert_params(m) / (ep * pp)
    rest = (params(m) - expert_params(m)) / (tp * pp)
    edp = dp // ep

    def sharded(x, d, stage):
        return x / d if zero >= stage else x

    return {"params": sharded(e, edp, 3) * by["param"] + sharded(rest, dp, 3) * by["param"],
            "grads": sharded(e, edp, 2) * by["grad"] + sharded(rest, dp, 2) * by["grad"],
            "optimizer": sharded(e, edp, 1) * optimizer_bytes + sharded(rest, dp, 1) * optimizer_bytes,
            "expert_params_per_gpu": e, "dense_params_per_gpu": rest}


def all_to_all(nbytes: float, ep: int, gpus_per_node: int, c: Cluster) -> float:
    """One all-to-all in which each GPU holds ``nbytes`` for the ep ranks (its own share stays)."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    local = min(ep, gpus_per_node)
    out_intra = nbytes * (local - 1) / ep
    out_inter = nbytes * (ep - local) / ep
    t = out_intra / c.intra.bandwidth_Bps
    if out_inter:
        t += out_inter / (c.node_bandwidth_Bps / c.gpus_per_node)
    alpha = c.inter.latency_s if ep > gpus_per_node else c.intra.latency_s
    return t + (ep - 1) * alpha


def ep_comm(m: MoEShape, micro_batch: int, cp: int, ep: int, act_bytes: int, c: Cluster) -> dict:
    """Token routing of one micro-batch on one GPU: 4 all-to-alls per MoE layer (fwd dispatch + combine,
    and the same backward)."""
    g = m.base
    tokens = micro_batch * g.seq / cp
    per = tokens * m.top_k * m.capacity_factor * g.hidden * act_bytes
    one = all_to_all(per, ep, c.gpus_per_node, c)
    calls = 4 * m.moe_layers
    return {"bytes_per_call": per, "calls": calls, "time_s": one * calls, "per_call_s": one}


def cp_comm(g: GPTShape, micro_batch: int, cp: int, act_bytes: int, block_rate: float, c: Cluster,
            crosses_nodes: bool = False) -> dict:
    """Ring attention's K/V passing for one micro-batch on one GPU over all layers, and what the
    blocks' attention compute (at ``block_rate`` FLOP/s) leaves exposed."""
    if cp <= 1:
        return {"bytes_per_step": 0.0, "steps": 0, "time_s": 0.0, "exposed_s": 0.0}
    chunk = g.seq / cp
    kv = 2 * micro_batch * chunk * g.kv_dim * act_bytes          # K and V of one chunk
    link = (c.node_bandwidth_Bps / c.gpus_per_node, c.inter.latency_s) if crosses_nodes else \
        (c.intra.bandwidth_Bps, c.intra.latency_s)
    send_f = kv / link[0] + link[1]
    send_b = 2 * kv / link[0] + link[1]                           # K, V and dK, dV
    block_f = 4 * micro_batch * chunk * chunk * g.hidden / block_rate
    block_b = 2 * block_f
    steps = (cp - 1) * g.layers
    return {"bytes_per_step": kv, "steps": steps, "time_s": steps * (send_f + send_b),
            "exposed_s": steps * (max(0.0, send_f - block_f) + max(0.0, send_b - block_b))}


def cp_shape(g: GPTShape, cp: int) -> GPTShape:
    """The shape one GPU's activations follow under cp: s/cp tokens (memory.gpt_layer_act_bytes on it)."""
    if g.seq % cp:
        raise ValueError(f"cp {cp} must divide the sequence {g.seq}")
    return replace(g, seq=g.seq // cp)


def min_chunk_for_overlap(g: GPTShape, act_bytes: int, rate: float, bandwidth: float) -> float:
    """Tokens per GPU above which the forward K/V send hides behind a block's attention:
    4 b c^2 h / rate >= 2 b c kv act / B  <=>  c >= rate x kv x act / (2 h B)."""
    return rate * g.kv_dim * act_bytes / (2 * g.hidden * bandwidth)


# Published MoE shapes (the sources' own figures in tests/plan/test_moe_cp.py)
MIXTRAL_8X7B = MoEShape(GPTShape(layers=32, hidden=4096, heads=32, kv_heads=8, seq=4096, vocab=32000, ffn=14336,
                                 gated=True, bias=False, norm="rmsnorm", tied=False, learned_pos=False),
                        experts=8, top_k=2, expert_ffn=14336)


def _mla_params(h: int = 7168, heads: int = 128, q_rank: int = 1536, kv_rank: int = 512, nope: int = 128,
                rope: int = 64, v: int = 128) -> int:
    """Multi-head latent attention's weights per layer (DeepSeek-V2/V3), its low-rank norms included."""
    return (h * q_rank + q_rank + q_rank * heads * (nope + rope) + h * (kv_rank + rope) + kv_rank
            + kv_rank * heads * (nope + v) + heads * v * h)


DEEPSEEK_V3 = MoEShape(GPTShape(layers=61, hidden=7168, heads=128, seq=4096, vocab=129280, ffn=18432, gated=True,
                                bias=False, norm="rmsnorm", tied=False, learned_pos=False),
                       experts=256, top_k=8, expert_ffn=2048, shared=1, dense_layers=3, attn_params=_mla_params())

MOE_PRESETS = {"mixtral-8x7b": MIXTRAL_8X7B, "deepseek-v3": DEEPSEEK_V3}
