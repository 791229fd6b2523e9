"""Expert parallelism (MoE models, ``--ep``): where the experts sit and what routing tokens to them costs.

Per GPU with expert parallelism ``ep`` (experts split over ep ranks carved out of the data-parallel ranks;
non-expert weights split by tp and pp as usual): under Megatron-core's layout, experts split by tp too (its
expert-tensor-parallel size defaults to tp), expert weights / (ep x tp x pp), their gradients reduced over the
expert-data-parallel group, dp x cp / ep ranks; under tandem's trainer each tp rank holds its experts whole,
expert weights / (ep x pp), reduced over (dp x cp / ep) x tp ranks (the runtime's experts_tp: params.expert_tp,
stage_states; ``expert_dp_group``). The rest / (tp x pp), reduced over dp x cp. Token routing is two all-to-alls in the forward (dispatch, combine)
and two in the backward per MoE layer per micro-batch, each carrying b x s/(cp x tp) x top_k x capacity_factor x h
values per GPU (sequence parallelism leaves s/(cp x tp) tokens on a GPU), of which (ep-1)/ep leave it. An
all-to-all's time: the bytes that cross the network at each GPU's share of its node's NICs, the rest at
the NVLink rate, plus ep-1 message latencies of the slowest link (NCCL runs it as ep-1 point-to-point
pairs). Nothing hides it (Megatron's default; DeepSeek-V3's DualPipe overlap is not modelled).
"""

from __future__ import annotations

from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.model import MoEShape
from tandem.plan.terms.collectives import Group, layout, link_name


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


def expert_dp_group(s, gpus_per_node: int, etp: int | None = None):
    """The ranks that hold the same experts: the tp / etp ranks holding them whole (adjacent; all tp under
    tandem's trainer, etp 1; none where the experts are split over tp, etp = tp, the default) and the cp ranks
    (etp apart), times the dp / ep replicas of the expert group (tp x cp x ep apart), laid out on nodes as
    tp, cp, dp, pp fill them."""
    etp = s.tp if etp is None else etp
    inner = s.tp // etp * s.cp
    size = s.dp // s.ep * inner
    if size <= 1:
        return Group(1, 1, 1)
    near = min(inner, max(1, gpus_per_node // etp))
    far_stride = s.tp * s.cp * s.ep
    far = max(1, min(s.dp // s.ep, gpus_per_node // far_stride)) if far_stride <= gpus_per_node else 1
    local = near * far if near == inner else near
    return Group(size, local, -(-size // local))


def ep_op(m, c: Cluster, s, by: dict, mb: int, stage_layers: int, recompute: str) -> dict:
    """MoE token routing of one step on the slowest stage's GPU, as CommOp fields: every micro-batch, the MoE layers
    among the stage's; with full recompute the forward's share runs twice."""
    fwd_passes = 2 if recompute == "full" else 1
    moe_n = stage_layers * m.moe.moe_layers / m.gpt.layers
    r = ep_comm(m.moe, s.micro_batch, s.cp, s.ep, by["act"], c, s.tp, moe_n, fwd_passes)
    grp = layout(s.ep, s.tp * s.cp, c.gpus_per_node)
    return dict(name="ep-all-to-all", collective="all_to_all", bytes=r["bytes_per_call"],
                calls=r["calls"] * mb, group=grp, link=link_name(grp, c), time_s=r["time_s"] * mb,
                exposed_s=r["time_s"] * mb, detail=(r["per_call_s"], r["calls"]),
                algorithm="pairwise")   # all_to_all: NVLink and per-GPU NIC shares, latency per peer (ep_comm)
