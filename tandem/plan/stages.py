"""Pipeline stages of a transformer: how many layers each holds, with the embedding on the first stage
and the output layer (logits) on the last.

Megatron-LM puts the word embedding on the first stage and the output layer on the last (a copy of
the embedding when tied); the last stage also computes the logits, 2*h*V FLOPs per token forward,
about half a layer for LLaMA-2 7B. The slowest stage sets the pace: with per-micro-batch stage times
t_i, a 1F1B or GPipe step takes m * max(t) + (sum(t) - max(t)) (every other stage's time once while
the pipeline fills and drains), which is (m + p - 1) * t for equal stages.

The planner's own split (when none is given) minimises the slowest stage with the logits counted on
the last stage, then takes the surplus from the costliest stages: the first (it holds the most
activations under 1F1B), then the last, then the middle on a tie. 126 layers on 16 stages give 7, 8 x 14, 7: Llama 3
405B's split (Dubey et al., *The Llama 3 Herd of Models*, 2024, §3.3.2: one layer fewer on the first
and the last stage).
"""

from __future__ import annotations

import math
from functools import lru_cache

from tandem.core.errors import ConfigError
from tandem.plan.model import GPTShape


def head_cost(g: GPTShape) -> float:
    """The logits' forward FLOPs in units of one layer's."""
    return g.logits_fwd_flops_per_token() / g.layer_fwd_flops_per_token()


@lru_cache(maxsize=4096)
def balanced(layers: int, pp: int, head: float) -> tuple[int, ...]:
    """Layer counts per stage minimising the costliest stage (layers + ``head`` on the last)."""
    extra = [0.0] * (pp - 1) + [head]

    def at(T: float) -> list[int]:
        return [max(0, math.floor(T - e + 1e-9)) for e in extra]

    cands = sorted({x + e for x in range(layers // pp, layers + 2) for e in (0.0, head)})
    counts = at(next(T for T in cands if sum(at(T)) >= layers))
    order = [0, pp - 1] + list(range(1, pp - 1)) if pp > 1 else [0]
    while sum(counts) > layers:  # take the surplus from the costliest: first, last, then the middle
        costs = [n + e for n, e in zip(counts, extra)]
        top = max(c for c, n in zip(costs, counts) if n > 0)
        i = next(i for i in order if counts[i] > 0 and costs[i] >= top - 1e-9)
        counts[i] -= 1
    return tuple(counts)


_SPLITS: dict[tuple, tuple[int, ...]] = {}   # the search asks for the same shape and pp thousands of times


def _key(g: GPTShape) -> tuple:
    return (g.layers, g.hidden, g.heads, g.kv_heads, g.ffn, g.gated, g.vocab, g.seq, g.bias, g.norm,
            g.learned_pos, g.tied)


def split(g: GPTShape, pp: int, given: tuple[int, ...] | None = None) -> tuple[int, ...]:
    if given:
        if len(given) != pp or sum(given) != g.layers or min(given) < 0:
            raise ConfigError(f"{len(given)} stage(s) with {sum(given)} layers in all, but pp {pp} and "
                              f"{g.layers} layers", field="stage-layers", value=",".join(map(str, given)),
                              fix=f"give {pp} non-negative counts that add up to {g.layers}, or leave it out "
                                  "for the planner's balanced split")
        return tuple(given)
    k = (_key(g), pp)
    if k not in _SPLITS:
        _SPLITS[k] = balanced(g.layers, pp, head_cost(g))
    return _SPLITS[k]


def imbalance(g: GPTShape, counts: tuple[int, ...], recompute_per_layer: float) -> float:
    """Slowest stage's FLOPs over the mean stage's (max(stage_flops) / mean, without the list)."""
    layer = 3 * g.layer_fwd_flops_per_token() + recompute_per_layer
    head = 3 * g.logits_fwd_flops_per_token()
    top = max(max(counts[:-1], default=0) * layer, counts[-1] * layer + head)
    return top * len(counts) / (sum(counts) * layer + head)


def stage_flops(g: GPTShape, counts: tuple[int, ...], recompute_per_layer: float) -> list[float]:
    """Hardware FLOPs per token of each stage (forward x 3 + recompute)."""
    layer = 3 * g.layer_fwd_flops_per_token() + recompute_per_layer
    head = 3 * g.logits_fwd_flops_per_token()
    return [n * layer + (head if i == len(counts) - 1 else 0.0) for i, n in enumerate(counts)]


def stage_params(g: GPTShape, counts: tuple[int, ...]) -> list[float]:
    """Parameters each stage holds: its layers, the embedding (first), the output layer or the tied
    embedding's copy and the final norm (last)."""
    h = g.hidden
    emb = g.vocab * h + (g.seq * h if g.learned_pos else 0)
    norm = 2 * h if g.norm == "layernorm" else h
    lp = g.layer_params()
    out = [float(n * lp) for n in counts]
    out[0] += emb
    out[-1] += g.vocab * h + norm
    return out


def max_stage_params(g: GPTShape, counts: tuple[int, ...]) -> float:
    """max(stage_params) without building the list (the search calls this for every candidate)."""
    k = (_key(g), counts)
    if k in _MAX_PARAMS:
        return _MAX_PARAMS[k]
    h, lp = g.hidden, g.layer_params()
    first = counts[0] * lp + g.vocab * h + (g.seq * h if g.learned_pos else 0)
    last = counts[-1] * lp + g.vocab * h + (2 * h if g.norm == "layernorm" else h)
    _MAX_PARAMS[k] = float(max(first, last, max(counts[1:-1], default=0) * lp))
    return _MAX_PARAMS[k]


_MAX_PARAMS: dict[tuple, float] = {}
