"""Expert parallelism (MoE) and context parallelism (ring attention): parameters, memory, communication.

Arithmetic on a ``GPTShape`` (tandem/plan/model.py) that ``evaluate`` (cost.py), ``memory`` and the search
use when a strategy has cp > 1 or ep > 1 or the model is an MoE (``moe_stats``); the degrees live in
ParallelDims (tandem/core/dims.py): world = pp x dp x cp x tp, ep inside dp.

**MoE** (``MoEShape``): the MLP of each MoE layer is ``experts`` routed experts of inner size
``expert_ffn`` (gated like the base shape) plus ``shared`` always-active ones and a router (h x experts);
the first ``dense_layers`` layers keep the base shape's dense MLP. Each token runs ``top_k`` routed
experts and the shared ones, so the FLOPs follow the active parameters. ``attn_params`` overrides the
attention block's parameter count per layer (multi-head latent attention, DeepSeek-V2/V3).

Per GPU with expert parallelism ``ep`` (Megatron-core's layout: experts split over ep ranks carved out
of the data-parallel ranks, and by tp as Megatron's expert-tensor-parallel size defaults to tp;
non-expert weights split by tp and pp as usual): expert weights / (ep x tp x pp), the rest / (tp x pp).
Expert gradients are reduced over the expert-data-parallel group, dp x cp / ep ranks; the rest over
dp x cp. Token routing is two all-to-alls in the forward (dispatch, combine) and two in the backward
per MoE layer per micro-batch, each carrying b x s/(cp x tp) x top_k x capacity_factor x h values per
GPU (sequence parallelism leaves s/(cp x tp) tokens on a GPU), of which (ep-1)/ep leave it. An
all-to-all's time: the bytes that cross the network at each GPU's share of its node's NICs, the rest at
the NVLink rate, plus ep-1 message latencies of the slowest link (NCCL runs it as ep-1 point-to-point
pairs). Nothing hides it (Megatron's default; DeepSeek-V3's DualPipe overlap is not modelled).

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

from tandem.plan import ring as RING
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


def dense_layer_params(m: MoEShape) -> float:
    """Non-expert parameters of the mean layer (attention, norms, router, shared experts, dense MLPs)."""
    return (params(m) - expert_params(m) - _outside_layers(m.base)) / m.base.layers


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
    """Model-state bytes per GPU (even layers per stage): expert weights / (ep x tp x pp), sharded further
    over the expert-data-parallel group (dp / ep) by ZeRO; everything else / (tp x pp), sharded over dp."""
    if dp % ep:
        raise ValueError(f"ep {ep} must divide dp {dp}")
    e = expert_params(m) / (ep * tp * pp)
    rest = (params(m) - expert_params(m)) / (tp * pp)
    edp = dp // ep

    def sharded(x, d, stage):
        return x / d if zero >= stage else x

    return {"params": sharded(e, edp, 3) * by["param"] + sharded(rest, dp, 3) * by["param"],
            "grads": sharded(e, edp, 2) * by["grad"] + sharded(rest, dp, 2) * by["grad"],
            "optimizer": sharded(e, edp, 1) * optimizer_bytes + sharded(rest, dp, 1) * optimizer_bytes,
            "expert_params_per_gpu": e, "dense_params_per_gpu": rest}


def all_to_all(nbytes: float, ep: int, gpus_per_node: int, c: Cluster, stride: int = 1) -> float:
    """One all-to-all in which each GPU holds ``nbytes`` for the ep ranks (its own share stays); the group's
    ranks are ``stride`` apart (tp x cp), so gpus_per_node / stride of them share a node."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    local = max(1, min(ep, gpus_per_node // stride))
    out_intra = nbytes * (local - 1) / ep
    out_inter = nbytes * (ep - local) / ep
    t = out_intra / c.intra.rate_Bps
    if out_inter:
        t += out_inter / (c.node_rate_Bps / c.gpus_per_node)
    alpha = c.inter.latency_s if ep > local else c.intra.latency_s
    return t + (ep - 1) * alpha


def ep_comm(m: MoEShape, micro_batch: int, cp: int, ep: int, act_bytes: int, c: Cluster, tp: int = 1,
            moe_layers: float | None = None, fwd_passes: int = 1) -> dict:
    """Token routing of one micro-batch on one GPU: 4 all-to-alls per MoE layer (fwd dispatch + combine,
    and the same backward; 2 more per layer when full recompute runs the forward again)."""
    g = m.base
    tokens = micro_batch * g.seq / (cp * tp)
    per = tokens * m.top_k * m.capacity_factor * g.hidden * act_bytes
    one = all_to_all(per, ep, c.gpus_per_node, c, stride=tp * cp)
    calls = round((2 + 2 * fwd_passes) * (m.moe_layers if moe_layers is None else moe_layers))
    return {"bytes_per_call": per, "calls": calls, "time_s": one * calls, "per_call_s": one}


def cp_comm(g: GPTShape, micro_batch: int, cp: int, act_bytes: int, block_rate: float, c: Cluster,
            crosses_nodes: bool = False, fwd_passes: int = 1, tp: int = 1, impl: str = "megatron",
            kv_repeat: bool = False) -> dict:
    """Ring attention's K/V passing for one micro-batch on one GPU over all layers, and what the
    blocks' attention compute (at ``block_rate`` FLOP/s) leaves exposed; per GPU, tp splitting the heads
    (``impl`` "torch": torch's all-gather rotation, tandem/plan/ring.py)."""
    if cp <= 1:
        return {"bytes_per_step": 0.0, "steps": 0, "time_s": 0.0, "exposed_s": 0.0}
    chunk = g.seq / cp
    kv = 2 * micro_batch * chunk * RING.kv_width(g, tp, kv_repeat) * act_bytes   # K and V of one chunk, this GPU
    link = (c.node_rate_Bps / c.gpus_per_node, c.inter.latency_s) if crosses_nodes else \
        (c.intra.rate_Bps, c.intra.latency_s)
    block_f = 4 * micro_batch * chunk * chunk * g.hidden / tp / block_rate
    block_b = 2 * block_f
    steps = (cp - 1) * g.layers
    if impl == "torch":
        r = RING.torch_ring(kv, cp, link, block_f, block_b, g.layers, fwd_passes)
        return {"bytes_per_step": kv, "steps": steps, **r, "block_f": block_f, "block_b": block_b}
    if impl == "allgather":   # one all-gather of the cp chunks forward, one reduce-scatter of dK, dV backward
        from tandem.plan.comm import collective, layout

        grp = layout(cp, tp, c.gpus_per_node)
        r = RING.allgather_cp(kv, cp, collective("all_gather", cp * kv, 1, grp, c)[0],
                              collective("reduce_scatter", cp * kv, 1, grp, c)[0], g.layers, fwd_passes)
        return {"bytes_per_step": kv, "steps": g.layers, **r, "block_f": block_f, "block_b": block_b}
    send_f = kv / link[0] + link[1]
    send_b = 2 * kv / link[0] + link[1]                           # K, V and dK, dV
    return {"bytes_per_step": kv, "steps": steps, "time_s": steps * (fwd_passes * send_f + send_b),
            "exposed_s": steps * (fwd_passes * max(0.0, send_f - block_f) + max(0.0, send_b - block_b)),
            "send_f": send_f, "send_b": send_b, "block_f": block_f, "block_b": block_b}


def cp_shape(g: GPTShape, cp: int) -> GPTShape:
    """The shape one GPU's activations follow under cp: s/cp tokens (memory.gpt_layer_act_bytes on it)."""
    if g.seq % cp:
        raise ValueError(f"cp {cp} must divide the sequence {g.seq}")
    return replace(g, seq=g.seq // cp)


def min_chunk_for_overlap(g: GPTShape, act_bytes: int, rate: float, bandwidth: float) -> float:
    """Tokens per GPU above which the forward K/V send hides behind a block's attention:
    4 b c^2 h / rate >= 2 b c kv act / B  <=>  c >= rate x kv x act / (2 h B)."""
    return rate * g.kv_dim * act_bytes / (2 * g.hidden * bandwidth)


def equivalent_shape(m: MoEShape) -> GPTShape:
    """The dense shape with an MoE layer's FLOPs per token: the top_k routed and the shared experts as one
    MLP of (top_k + shared) x expert_ffn (attention as GPTShape counts it; the router left out)."""
    return replace(m.base, ffn=m.expert_ffn * (m.top_k + m.shared))


def moe_stats(m: MoEShape, name: str = "moe", seq: int | None = None):
    from tandem.plan.model import ModelStats

    if seq:
        m = replace(m, base=replace(m.base, seq=seq))
    g = m.base
    largest = max(_attn_norm_params(m) + max(mlp_params(g, g.ffn) if m.dense_layers else 0,
                                             (m.experts + m.shared) * mlp_params(g, m.expert_ffn)),
                  g.vocab * g.hidden)
    return ModelStats(name, "gpt", params(m), gpt=equivalent_shape(m), source="preset (MoE)",
                      largest_layer_params=largest, moe=m)


def mlp_act_coeff(m: MoEShape) -> float:
    """Korthikanti et al.'s MLP activation term per s x b x h (2-byte units) for an MoE layer: the layer's
    input and dropout mask (3) plus, per routed copy of a token (top_k x capacity factor) and per shared
    expert, its permuted input (2) and the expert's inner activations (4 x ffn/h, 6 gated)."""
    g = m.base
    inner = (6 if g.gated else 4) * m.expert_ffn / g.hidden
    return 3 + (m.top_k * m.capacity_factor + m.shared) * (2 + inner)


_STAGES: dict[tuple, tuple[float, float]] = {}


def stage_states(m: MoEShape, counts: tuple[int, ...], tp: int, ep: int) -> tuple[float, float]:
    """(non-expert, expert) parameters per GPU on the stage that holds the most per GPU: the first stage
    also holds the embedding and the dense layers (the first ``dense_layers``), the last the output layer."""
    g = m.base
    key = (repr(m), counts, tp, ep)
    if key in _STAGES:
        return _STAGES[key]
    h = g.hidden
    attn, e_mlp = _attn_norm_params(m), mlp_params(g, m.expert_ffn)
    best, start = (0.0, 0.0), 0
    for i, n in enumerate(counts):
        dense_n = max(0, min(start + n, m.dense_layers) - start)
        moe_n = n - dense_n
        rest = n * attn + dense_n * mlp_params(g, g.ffn) + moe_n * (m.shared * e_mlp + h * m.experts)
        if i == 0:
            rest += g.vocab * h + (g.seq * h if g.learned_pos else 0)
        if i == len(counts) - 1:
            rest += g.vocab * h * (0 if g.tied and len(counts) == 1 else 1) + (2 * h if g.norm == "layernorm" else h)
        cand = (rest / tp, moe_n * m.experts * e_mlp / (ep * tp))
        if sum(cand) > sum(best):
            best = cand
        start += n
    _STAGES[key] = best
    return best


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


def expert_dp_group(s, gpus_per_node: int):
    """The ranks that hold the same experts: the cp ranks (tp apart) times the dp / ep replicas of the expert
    group (tp x cp x ep apart), laid out on nodes as tp, cp, dp, pp fill them."""
    from tandem.plan.comm import Group

    size = s.dp * s.cp // s.ep
    if size <= 1:
        return Group(1, 1, 1)
    near = min(s.cp, max(1, gpus_per_node // s.tp))
    far_stride = s.tp * s.cp * s.ep
    far = max(1, min(s.dp // s.ep, gpus_per_node // far_stride)) if far_stride <= gpus_per_node else 1
    local = near * far if near == s.cp else near
    return Group(size, local, -(-size // local))


def check_cp_ep(m, s) -> str | None:
    """Why cp/ep do not fit this model and strategy (``ModelStats``, ``Strategy``), or None."""
    if s.cp > 1:
        if m.gpt is None:
            return f"cp {s.cp} needs a transformer shape; {m.name} is a {m.kind} model"
        if m.gpt.seq % (2 * s.cp):
            # load-balanced causal ring attention cuts the sequence into 2 x cp chunks (Megatron-core)
            return (f"cp {s.cp} does not split seq {m.gpt.seq} into 2 x cp = {2 * s.cp} equal chunks "
                    f"({m.gpt.seq} % {2 * s.cp} = {m.gpt.seq % (2 * s.cp)})")
    if s.ep > 1:
        if m.moe is None:
            return f"ep {s.ep} needs an MoE model (mixtral-8x7b, deepseek-v3 or --experts); {m.name} is dense"
        if s.dp % s.ep:
            return f"ep {s.ep} does not divide dp {s.dp} ({s.dp} % {s.ep} = {s.dp % s.ep})"
        if m.moe.experts % s.ep:
            return (f"ep {s.ep} does not divide the {m.moe.experts} experts "
                    f"({m.moe.experts} % {s.ep} = {m.moe.experts % s.ep})")
    if m.moe is not None and m.moe.expert_ffn % s.tp:
        return f"expert ffn {m.moe.expert_ffn} is not divisible by tp {s.tp}"
    return None


def cp_ep_ops(m, c: Cluster, s, by: dict, mb: int, stage_layers: int, attn_rate: float, recompute: str,
              impl: str = "megatron", kv_repeat: bool = False) -> list[dict]:
    """Ring attention's K/V exchange and MoE token routing of one step on the slowest stage's GPU, as
    CommOp fields: every micro-batch, every layer the stage holds; with full recompute the forward's
    share runs twice."""
    from tandem.plan.comm import layout, link_name

    out: list[dict] = []
    fwd_passes = 2 if recompute == "full" else 1
    g = m.gpt
    if s.cp > 1:
        grp = layout(s.cp, s.tp, c.gpus_per_node)
        rate = attn_rate   # at the ring's block length already (efficiency.attention_rate)
        r = cp_comm(replace(g, layers=stage_layers), s.micro_batch, s.cp, by["act"], rate, c,
                    grp.crosses_nodes, fwd_passes, s.tp, impl, kv_repeat)
        # bytes per call as the JSON counts them (comm.all_gather's convention, nccl-tests' size): one chunk per
        # send of the p2p rings; the gathered K/V of all cp chunks (the reduce-scatter's input) for all-gather CP
        out.append(dict(name="cp-ring", collective="all_gather" if impl == "allgather" else "send_recv",
                        bytes=r["bytes_per_step"] * (s.cp if impl == "allgather" else 1),
                        calls=r["steps"] * mb * (fwd_passes + 1), group=grp,
                        link=link_name(grp, c), time_s=r["time_s"] * mb, exposed_s=r["exposed_s"] * mb,
                        rule="none" if impl == "allgather" else "ring-attention",
                        window_s=r["block_f"], detail=(r["send_f"], r["send_b"], r["block_f"], r["block_b"],
                                                       fwd_passes, impl)))
    if s.ep > 1 and m.moe is not None:
        moe_n = stage_layers * m.moe.moe_layers / g.layers
        r = ep_comm(m.moe, s.micro_batch, s.cp, s.ep, by["act"], c, s.tp, moe_n, fwd_passes)
        grp = layout(s.ep, s.tp * s.cp, c.gpus_per_node)
        out.append(dict(name="ep-all-to-all", collective="all_to_all", bytes=r["bytes_per_call"],
                        calls=r["calls"] * mb, group=grp, link=link_name(grp, c), time_s=r["time_s"] * mb,
                        exposed_s=r["time_s"] * mb, detail=(r["per_call_s"], r["calls"])))
    return out
