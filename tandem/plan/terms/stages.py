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

With the interleaved schedule (v model chunks a stage) the default split follows Megatron-LM: every stage builds
num_layers / pp layers in v chunks of num_layers / (pp x v) (megatron/core/transformer/transformer_block.py,
get_num_layers_to_build; megatron/training/arguments.py asserts the layers divide that way), so 96 layers on
12 stages x 8 chunks (Nemotron-4 340B) or 8 x 12 (NeMo's recipe) run one or two layers a chunk, the output layer
on an even split. Where pp x v does not divide the layers (Megatron would need explicit uneven counts), the
balanced split above is taken with at least v layers on every stage, one a chunk; fewer than pp x v layers
cannot be interleaved and are refused.
"""

from __future__ import annotations

import math
from functools import lru_cache

from tandem.core.errors import ConfigError
from tandem.plan.inputs.model import GPTShape


def head_cost(g: GPTShape) -> float:
    """The logits' forward FLOPs in units of one layer's."""
    return g.logits_fwd_flops_per_token() / g.layer_fwd_flops_per_token()


@lru_cache(maxsize=4096)
def balanced(layers: int, pp: int, head: float, least: int = 0) -> tuple[int, ...]:
    """Layer counts per stage minimising the costliest stage (layers + ``head`` on the last), each at least
    ``least`` (the interleaved schedule's chunks a stage; layers >= pp x least)."""
    extra = [0.0] * (pp - 1) + [head]

    def at(T: float) -> list[int]:
        return [max(least, math.floor(T - e + 1e-9)) for e in extra]

    cands = sorted({x + e for x in range(layers // pp, layers + 2) for e in (0.0, head)})
    counts = at(next(T for T in cands if sum(at(T)) >= layers))
    order = [0, pp - 1] + list(range(1, pp - 1)) if pp > 1 else [0]
    while sum(counts) > layers:  # take the surplus from the costliest: first, last, then the middle
        costs = [n + e for n, e in zip(counts, extra)]
        top = max(c for c, n in zip(costs, counts) if n > least)
        i = next(i for i in order if counts[i] > least and costs[i] >= top - 1e-9)
        counts[i] -= 1
    return tuple(counts)


_SPLITS: dict[tuple, tuple[int, ...]] = {}   # the search asks for the same shape and pp thousands of times


def _key(g: GPTShape) -> tuple:
    return (g.layers, g.hidden, g.heads, g.kv_heads, g.ffn, g.gated, g.vocab, g.seq, g.bias, g.norm,
            g.learned_pos, g.tied)


def chunks_of(s) -> int:
    """Model chunks a stage holds under strategy ``s``: its virtual stages when interleaved, else 1."""
    return s.virtual if s.schedule == "interleaved" else 1


def split_name(s, g: GPTShape) -> str:
    """Which split ``split`` takes for strategy ``s`` (the explain line and the assumptions both name it)."""
    v = chunks_of(s)
    return ("given (--stage-layers)" if s.stage_layers else
            f"Megatron's even split, {g.layers} / ({s.pp} x {v}) a chunk" if v > 1 and g.layers % (s.pp * v) == 0
            else f"the planner's balanced split, at least {v} a stage" if v > 1 else "the planner's balanced split")


def split(g: GPTShape, pp: int, given: tuple[int, ...] | None = None, v: int = 1) -> tuple[int, ...]:
    """Layers per stage: ``given`` per stage, or per model chunk (pp x v counts, chunk j on stage j mod pp,
    folded into stage sums), else the planner's split for ``v`` chunks a stage: balanced (v = 1), Megatron's
    even split where pp x v divides the layers, else balanced with at least v a stage (module docstring)."""
    if given:
        if len(given) % pp or sum(given) != g.layers or min(given) < 0:
            raise ConfigError(f"{len(given)} count(s) with {sum(given)} layers in all, but pp {pp} and "
                              f"{g.layers} layers", field="stage-layers", value=",".join(map(str, given)),
                              fix=f"give {pp} non-negative counts (one per stage, or pp x virtual, one per "
                                  f"chunk) that add up to {g.layers}, or leave it out for the planner's "
                                  "balanced split")
        return tuple(sum(given[i::pp]) for i in range(pp))
    k = (_key(g), pp, v)
    if k not in _SPLITS:
        if v > 1 and g.layers < pp * v:
            raise ConfigError(f"{g.layers} layers cannot fill {pp} stages x {v} interleaved chunks "
                              f"({pp * v} chunks of at least one layer)", field="virtual", value=v,
                              fix=f"use --virtual {max(1, g.layers // pp)} or less, or fewer pipeline stages")
        if v > 1 and g.layers % (pp * v) == 0:
            _SPLITS[k] = (g.layers // pp,) * pp
        else:
            _SPLITS[k] = balanced(g.layers, pp, head_cost(g), v if v > 1 else 0)
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


@lru_cache(maxsize=65536)   # memory and the cost model ask for it per candidate
def busiest_stage_params(g: GPTShape, pp: int, given: tuple[int, ...] | None, v: int) -> float:
    """max_stage_params of the split ``split(g, pp, given, v)`` takes."""
    return max_stage_params(g, split(g, pp, given, v))


# ---- interleaved (virtual-stage) 1F1B over uneven stages
#
# Stage i holds model chunks i, i + p, ..., i + (v-1)p (Megatron-LM's and torch.distributed.pipelining's
# placement). The schedule modelled is torch's ScheduleInterleaved1F1B, which is Megatron-LM's depth-first
# interleaved 1F1B (Narayanan et al. 2021, §2.2.2: bubble (p-1)/(v m) of the ideal time for equal chunks)
# with its micro-batch rule relaxed as Llama 3's (Dubey et al. 2024, §3.3.2): micro-batches run in rounds of
# m // max(1, m // p), and m must be a multiple of the number of rounds.


def rounds(m: int, pp: int) -> int:
    """torch's ScheduleInterleaved1F1B: max(1, m // pp) rounds of m / rounds micro-batches each."""
    return max(1, m // pp)


@lru_cache(maxsize=4096)
def even_chunks(n: int, v: int) -> tuple[int, ...]:
    """n layers in v chunks as even as possible, the extra layers in the middle chunks: each stage's first
    chunk is what the pipeline fill waits on and its last what the drain waits on (``fill_units``)."""
    base, r = divmod(n, v)
    mid = (v - 1) / 2
    extra = set(sorted(range(v), key=lambda k: (abs(k - mid), k))[:r])
    return tuple(base + (k in extra) for k in range(v))


def chunks(g: GPTShape, pp: int, v: int, given: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """Layers of each model chunk, per stage: ``given`` per chunk (pp x v counts, chunk j on stage j mod pp),
    or per stage (split evenly over its v chunks), else the balanced split so divided."""
    k = (_key(g), pp, v, given)
    if k not in _CHUNKS:   # the search asks thousands of times; an impossible split is remembered too
        try:
            _CHUNKS[k] = _chunks(g, pp, v, given)
        except ConfigError as e:
            _CHUNKS[k] = e
    if isinstance(_CHUNKS[k], ConfigError):
        raise _CHUNKS[k]
    return _CHUNKS[k]


_CHUNKS: dict[tuple, tuple[tuple[int, ...], ...] | ConfigError] = {}


def _chunks(g: GPTShape, pp: int, v: int, given: tuple[int, ...] | None) -> tuple[tuple[int, ...], ...]:
    value = ",".join(map(str, given)) if given else None
    if given and v == 1 and len(given) != pp:
        raise ConfigError(f"{len(given)} counts, but pp {pp} takes {pp} (one per stage); per-chunk counts need "
                          "--schedule interleaved", field="stage-layers", value=value,
                          fix=f"give {pp} per-stage layer counts, or --schedule interleaved --virtual V with "
                              f"{pp} x V per-chunk counts")
    if given and len(given) not in (pp, pp * v):
        raise ConfigError(f"{len(given)} counts, but pp {pp} x virtual {v} takes {pp} (one per stage) or "
                          f"{pp * v} (one per chunk)", field="stage-layers", value=value,
                          fix=f"give {pp} per-stage or {pp * v} per-chunk layer counts")
    counts = split(g, pp, given, v)
    if given and len(given) == pp * v:
        out = tuple(tuple(given[i + k * pp] for k in range(v)) for i in range(pp))
    else:
        out = tuple(even_chunks(n, v) for n in counts)
    if v > 1:
        for i, c in enumerate(out):
            # the first chunk of the first stage may hold the embedding alone and the last chunk of the last
            # stage the output layer and loss alone (Llama 3, §3.3.2: one layer fewer on the first and last)
            ends = [k for k in range(v) if (i, k) not in ((0, 0), (pp - 1, v - 1))] if per_chunk_given(given, pp, v) \
                else range(v)
            if min(c[k] for k in ends) < 1:
                k = min(ends, key=lambda k: c[k])
                per_chunk = per_chunk_given(given, pp, v)
                why = (f"chunk {i + k * pp} (stage {i}) has no layer" if per_chunk else
                       f"stage {i} holds {counts[i]} layer(s), fewer than its {v} interleaved chunks")
                raise ConfigError(f"{why}: every chunk needs at least one layer", value=value or v,
                                  field="stage-layers" if given else "virtual",
                                  fix="give every chunk at least one layer (the first and the last chunk of the "
                                      "model may hold none: the embedding, the output layer alone)" if per_chunk else
                                  f"use --virtual {max(1, min(counts))} or less, or give per-stage counts of "
                                  f"at least {v} (--stage-layers)")
    return out


def per_chunk_given(given: tuple[int, ...] | None, pp: int, v: int) -> bool:
    return bool(given) and len(given) == pp * v


@lru_cache(maxsize=4096)
def fill_units(per_stage: tuple[tuple[int, ...], ...], layer_f: float, layer_b: float, head_f: float,
               head_b: float, m: int) -> float:
    """Pipeline fill and drain in units of the mean stage's time per micro-batch.

    The slowest stage k sets the pace (m x T_k); while the pipeline fills, the first micro-batch's forward
    crosses every other stage's first chunk, and each time the chunks grow (c_j > c_j-1) the front of the
    next round of chunks falls behind by the growth on each stage it crosses; the drain mirrors it
    backward. Per stage the forward's wait is F x (c_0 + sum of the rises), the backward's B x (c_v-1 + sum
    of the falls), max(c) x (F + B) for chunks that rise then fall (forward F = a layer's forward FLOPs,
    backward B = 2 x that + recompute; the logits with the last chunk of the last stage); summed over the
    stages other than k. One chunk per stage gives sum(T) - max(T); v equal chunks Megatron's (p-1) T / v.
    With fewer micro-batches than stages (m < p, rounds of m) every one of the v-1 chunk changes also waits
    p - m chunk times for the round's first micro-batch to come back: + (v-1)(p-m) T_mean / v."""
    p, v = len(per_stage), len(per_stage[0])
    T = [sum(c) * (layer_f + layer_b) for c in per_stage]
    T[-1] += head_f + head_b
    k = max(range(p), key=lambda i: (T[i], i))
    fronts = [(c[0] + sum(max(0, b - a) for a, b in zip(c, c[1:])),
               c[-1] + sum(max(0, a - b) for a, b in zip(c, c[1:]))) for c in per_stage]
    ends = [f * layer_f + b * layer_b for f, b in fronts]
    ends[-1] += head_b + (head_f if v == 1 else 0.0)
    mean = sum(T) / p
    wait = sum(e for i, e in enumerate(ends) if i != k)
    if v > 1 and m < p:
        wait += (v - 1) * (p - m) * mean / v
    return wait / mean


def schedule_order(v: int, pp: int, m: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s forwards ("F") and backwards ("B") with their chunk, in torch's (interleaved) 1F1B
    (_get_warmup_ops; Megatron's num_warmup_microbatches): (v-1) x round + 2(p-1-rank) warm-up forwards (one
    chunk: p-1-rank), then forward/backward pairs, then the cool-down backwards; the j-th forward on chunk
    (j // round) mod v, the k-th backward on chunk v-1 - (k // round) mod v."""
    rnd = m // rounds(m, pp) if v > 1 else m
    warm = min(m * v, (v - 1) * rnd + 2 * (pp - 1 - rank)) if v > 1 else min(m, pp - 1 - rank)
    fwd = [("F", (j // rnd) % v) for j in range(m * v)]
    bwd = [("B", v - 1 - (k // rnd) % v) for k in range(m * v)]
    out = fwd[:warm]
    for j in range(warm, m * v):
        out += [fwd[j], bwd[j - warm]]
    return out + bwd[m * v - warm:]


@lru_cache(maxsize=65536)
def stage_inflight(held: tuple[int, ...], pp: int, m: int, rank: int = 0) -> float:
    """Layers of activations pipeline rank ``rank`` (chunks ``held``) holds at its peak under (interleaved)
    1F1B, over its whole schedule (``schedule_order``): the warm-up's chunk forwards, (v-1) x round +
    2(p-1-rank) + the first steady-state one (at most all m x v); with uneven chunks the steady state can
    grow it further, a forward on a larger chunk pairing with a backward on a smaller one. One chunk: min(p -
    rank, m) micro-batches. Equal chunks on the first stage give L/p x p (1 + (p-1)/(p v)) (Korthikanti et
    al. 2022, §4.2.3)."""
    v = len(held)
    if v == 1:
        return float(held[0] * min(pp - rank, m))
    if len(set(held)) == 1:   # equal chunks: the warm-up's end is the peak (steady pairs add and free a chunk)
        return float(held[0] * min(m * v, (v - 1) * (m // rounds(m, pp)) + 2 * (pp - 1 - rank) + 1))
    act = best = 0
    for kind, c in schedule_order(v, pp, m, rank):
        act += held[c] if kind == "F" else -held[c]
        best = max(best, act)
    return float(best)


def first_stage_inflight(first: tuple[int, ...], pp: int, m: int) -> float:
    return stage_inflight(first, pp, m, 0)

def pipeline(m, s, compute: float, mb: int) -> tuple[tuple[int, ...], float, float]:
    """(layers per stage, slowest over mean stage, bubble seconds) of ``compute`` seconds of mean-stage work
    over ``mb`` micro-batches (``m`` ModelStats, ``s`` Strategy); no pipeline: ((), 1, 0)."""
    if s.pp <= 1:
        return (), 1.0, 0.0
    v = chunks_of(s)
    if m.gpt is None:   # equal stages: (p-1)/v, + (v-1)(p-m)/v with fewer micro-batches than stages
        return (), 1.0, compute * (s.pp - 1 + (v - 1) * max(0, s.pp - mb)) / v / mb
    g = m.gpt
    rc = m.recompute_flops_per_sample(s.recompute) / (g.seq * g.layers)
    counts, imb, fill = _stages(g, s.pp, v, s.stage_layers, rc, mb)
    return counts, imb, compute * fill / mb


@lru_cache(maxsize=65536)   # pure in a frozen shape and numbers: the search asks for each split many times
def _stages(g: GPTShape, pp: int, v: int, given: tuple[int, ...] | None, rc: float,
            mb: int) -> tuple[tuple[int, ...], float, float]:
    """(layers per stage, slowest over mean stage, fill and drain in mean-stage micro-batch times)."""
    counts = split(g, pp, given, v)
    f, h = g.layer_fwd_flops_per_token(), g.logits_fwd_flops_per_token()
    fill = fill_units(chunks(g, pp, v, given), f, 2 * f + rc, h, 2 * h, mb)
    return counts, imbalance(g, counts, rc), fill
