"""Parameters per GPU: the stage holding the most (embedding, output layer, an MoE model's experts), and the
ranks a ZeRO stage shards them over. Memory, the data-parallel terms, the optimizer step and the explanation all
count from here."""

from __future__ import annotations

from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.model import ModelStats, MoEShape, attn_norm_params, mlp_params
from tandem.plan.inputs.runtime import RUNTIMES
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.stages import busiest_stage_params, chunks_of, split


def shard_group(s: Strategy, c: Cluster) -> int:
    """Ranks a ZeRO stage shards over: all of dp, or (HSDP) only the dp ranks on one node: the
    dims' dp_shard (ParallelDims.from_degrees sized it for the cluster's nodes), times cp: the cp ranks
    hold the same weights, and Megatron's distributed optimizer shards over dp x cp."""
    return s.dims.dp_shard * s.cp


def expert_tp(t: Training, s: Strategy) -> int:
    """The tp ranks one expert's weights are split over: tp where the runtime splits the experts (Megatron's
    expert-tensor-parallel size = tp), 1 where each tp rank holds its experts whole (tandem's trainer;
    runtime.py's experts_tp)."""
    return s.tp if RUNTIMES[t.runtime].experts_tp else 1


def expert_shard_group(s: Strategy, c: Cluster, t: Training) -> int:
    """Ranks the ZeRO stage shards expert states over: the ranks holding the same experts, the
    expert-data-parallel dp x cp / ep, times the tp ranks where those hold the experts whole (tandem)."""
    return max(1, shard_group(s, c) // s.ep) * (s.tp // expert_tp(t, s))


def expert_states(m: ModelStats, s: Strategy, t: Training) -> tuple[float, float]:
    """(non-expert, expert) parameters per GPU of an MoE model on the stage holding the most, the experts
    split as the runtime splits them (stage_states)."""
    return stage_states(m.moe, split(m.gpt, s.pp, s.stage_layers, chunks_of(s)), s.tp, s.ep, expert_tp(t, s))


def stage_psi(m: ModelStats, s: Strategy, t: Training | None = None) -> float:
    """Parameters per GPU on the stage holding the most: with a pipeline, the first (embedding) or the last
    (output layer, or the tied embedding's copy Megatron keeps there). ``t``: the runtime whose expert layout
    picks an MoE model's busiest stage (Megatron's when not given)."""
    if m.moe is not None:   # the non-expert weights; expert gradients go over their own group (dp_ops)
        if t is not None:
            return expert_states(m, s, t)[0]
        return stage_states(m.moe, split(m.gpt, s.pp, s.stage_layers, chunks_of(s)), s.tp, s.ep)[0]
    if m.gpt is None or s.pp == 1:
        return m.params / (s.tp * s.pp)
    return busiest_stage_params(m.gpt, s.pp, s.stage_layers, chunks_of(s)) / s.tp


def updated_params(m: ModelStats, s: Strategy, c: Cluster, t: Training) -> float:
    """Parameters the optimizer step updates on the busiest GPU: its stage's, / the ZeRO shard group; an MoE
    model's experts too (split over ep, and tp where the runtime splits them; sharded over the ranks holding
    the same experts)."""
    if m.moe is None:
        return stage_psi(m, s) / (shard_group(s, c) if s.zero else 1)
    ne, e = expert_states(m, s, t)
    return ne / (shard_group(s, c) if s.zero else 1) + e / (expert_shard_group(s, c, t) if s.zero else 1)


_STAGES: dict[tuple, tuple[float, float]] = {}


def stage_states(m: MoEShape, counts: tuple[int, ...], tp: int, ep: int, etp: int | None = None) -> tuple[float, float]:
    """(non-expert, expert) parameters per GPU on the stage that holds the most per GPU: the first stage
    also holds the embedding and the dense layers (the first ``dense_layers``), the last the output layer.
    The non-expert weights / tp, the experts / (ep x etp): ``etp`` the tp ranks an expert is split over
    (tp when not given, Megatron's layout; 1 under tandem's trainer: expert_tp)."""
    g = m.base
    etp = tp if etp is None else etp
    key = (repr(m), counts, tp, ep, etp)
    if key in _STAGES:
        return _STAGES[key]
    h = g.hidden
    attn, e_mlp = attn_norm_params(m), mlp_params(g, m.expert_ffn)
    best, start = (0.0, 0.0), 0
    for i, n in enumerate(counts):
        dense_n = max(0, min(start + n, m.dense_layers) - start)
        moe_n = n - dense_n
        rest = n * attn + dense_n * mlp_params(g, g.ffn) + moe_n * (m.shared * e_mlp + h * m.experts)
        if i == 0:
            rest += g.vocab * h + (g.seq * h if g.learned_pos else 0)
        if i == len(counts) - 1:
            rest += g.vocab * h * (0 if g.tied and len(counts) == 1 else 1) + (2 * h if g.norm == "layernorm" else h)
        cand = (rest / tp, moe_n * m.experts * e_mlp / (ep * etp))
        if sum(cand) > sum(best):
            best = cand
        start += n
    _STAGES[key] = best
    return best


