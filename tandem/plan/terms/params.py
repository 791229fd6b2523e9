"""Parameters per GPU: the stage holding the most (embedding, output layer, an MoE model's experts), and the
ranks a ZeRO stage shards them over. Memory, the data-parallel terms, the optimizer step and the explanation all
count from here."""

from __future__ import annotations

from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.model import ModelStats, MoEShape, attn_norm_params, mlp_params
from tandem.plan.inputs.training import Strategy
from tandem.plan.terms.stages import busiest_stage_params, chunks_of, split


def shard_group(s: Strategy, c: Cluster) -> int:
    """Ranks a ZeRO stage shards over: all of dp, or (HSDP) only the dp ranks on one node: the
    dims' dp_shard (ParallelDims.from_degrees sized it for the cluster's nodes), times cp: the cp ranks
    hold the same weights, and Megatron's distributed optimizer shards over dp x cp."""
    return s.dims.dp_shard * s.cp


def expert_shard_group(s: Strategy, c: Cluster) -> int:
    """Ranks the ZeRO stage shards expert states over: the expert-data-parallel ranks, dp x cp / ep."""
    return max(1, shard_group(s, c) // s.ep)


def stage_psi(m: ModelStats, s: Strategy) -> float:
    """Parameters per GPU on the stage holding the most: with a pipeline, the first (embedding) or the last
    (output layer, or the tied embedding's copy Megatron keeps there)."""
    if m.moe is not None:   # the non-expert weights; expert gradients go over their own group (dp_ops)
        return stage_states(m.moe, split(m.gpt, s.pp, s.stage_layers, chunks_of(s)), s.tp, s.ep)[0]
    if m.gpt is None or s.pp == 1:
        return m.params / (s.tp * s.pp)
    return busiest_stage_params(m.gpt, s.pp, s.stage_layers, chunks_of(s)) / s.tp


def updated_params(m: ModelStats, s: Strategy, c: Cluster) -> float:
    """Parameters the optimizer step updates on the busiest GPU: its stage's, / the ZeRO shard group; an MoE
    model's experts too (split over ep x tp, sharded over the expert-data-parallel ranks)."""
    if m.moe is None:
        return stage_psi(m, s) / (shard_group(s, c) if s.zero else 1)
    ne, e = stage_states(m.moe, split(m.gpt, s.pp, s.stage_layers, chunks_of(s)), s.tp, s.ep)
    return ne / (shard_group(s, c) if s.zero else 1) + e / (expert_shard_group(s, c) if s.zero else 1)


_STAGES: dict[tuple, tuple[float, float]] = {}


def stage_states(m: MoEShape, counts: tuple[int, ...], tp: int, ep: int) -> tuple[float, float]:
    """(non-expert, expert) parameters per GPU on the stage that holds the most per GPU: the first stage
    also holds the embedding and the dense layers (the first ``dense_layers``), the last the output layer."""
    g = m.base
    key = (repr(m), counts, tp, ep)
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
        cand = (rest / tp, moe_n * m.experts * e_mlp / (ep * tp))
        if sum(cand) > sum(best):
            best = cand
        start += n
    _STAGES[key] = best
    return best


