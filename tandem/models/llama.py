"""A Llama-style decoder: rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases.

    model = Llama(LlamaConfig(layers=4, hidden=64, heads=4, kv_heads=2, seq=16, vocab=16))
    logits = model(tokens)          # (B, T) int64 -> (B, T, vocab)

The layout is the GPT's (``tandem/models/gpt.py``): ``tok_emb``, ``rope`` (the rotary cos/sin
table, a buffer every pipeline stage keeps), ``layers`` (a ModuleDict "0".."L-1" of pre-norm
blocks), ``norm`` and ``head``, each ``None`` on a pipeline stage that does not own it; the
strategies read the names from ``layout`` (``tandem/models/layout.py``). The options cover
the models shaped like it: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3: RMSNorm on each head's
queries and keys before the rotation), ``head_dim`` apart from hidden / heads (Qwen3),
``rope_theta`` and ``rope_scaling`` (Llama 3.1's ``llama3`` or ``linear``), ``tied``; ``experts`` > 0 turns
every block's MLP into a mixture of experts (``tandem/models/moe.py``: top_k, shared_experts, expert_ffn,
capacity_factor, router_aux_loss, router_z_loss).

The rotation is Hugging Face's (``rotate_half``: feature i turns with feature i + head_dim/2),
so a Hugging Face Llama / Qwen checkpoint's q/k weights load without the permutation Meta's
interleaved layout needs. Attention computes its local head counts from the weight shapes, so
the same code runs with the projections split column-wise across tp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.decoder import check_llama, ffn_size, head_dim, rope_scaling
from tandem.core.experts import check_moe
from tandem.models.init import init_weights
from tandem.models.kvcache import LOCAL, KVCache, Packed, cached_attention
from tandem.models.layout import DecoderLayout
from tandem.models.moe import GroupedExperts, MoE, init_expert


@dataclass
class LlamaConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 0      # 0: same as heads (multi-head); fewer: grouped-query attention
    ffn: int = 0           # 0: Llama's rule (tandem/core/decoder.py)
    head_dim: int = 0      # 0: hidden / heads
    seq: int = 16
    vocab: int = 16
    tied: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    # mixture of experts (tandem/models/moe.py): experts > 0 puts an MoE in every block's MLP
    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0
    expert_ffn: int = 0    # 0: ffn
    capacity_factor: float = 1.25
    router_aux_loss: float = 0.01
    router_z_loss: float = 0.0
    name: str = "llama"

    def __post_init__(self):
        check_llama(self)
        check_moe(self)
        self.ffn = ffn_size(self)
        self.head_dim = head_dim(self)
        self.kv_heads = self.kv_heads or self.heads
        self.rope_scaling = rope_scaling(self)


def inverse_frequencies(c: LlamaConfig) -> torch.Tensor:
    """Rotation speed of each feature pair (head_dim / 2 of them), after ``rope_scaling``, in float64."""
    d = c.head_dim
    inv = 1.0 / c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    s = c.rope_scaling
    if s.get("rope_type") == "linear":
        return inv / s["factor"]
    if s.get("rope_type") == "llama3":  # Llama 3.1: long wavelengths slowed by factor, short kept, a ramp between
        old, lo, hi, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                               s["factor"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)
        return (1 - smooth) * inv / factor + smooth * inv
    return inv


class Rotary(nn.Module):
    """The cos and sin of every position's angles, (2, seq, head_dim): a buffer, not a parameter,
    left out of checkpoints (``persistent=False``) and recomputed from the config."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.register_buffer("cache", torch.empty(2, c.seq, c.head_dim), persistent=False)

    def table(self) -> torch.Tensor:
        c = self.config
        angles = torch.outer(torch.arange(c.seq, dtype=torch.float64), inverse_frequencies(c))
        angles = torch.cat([angles, angles], dim=-1)
        return torch.stack([angles.cos(), angles.sin()]).float()


def rotate(x: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, T, heads, head_dim) turned by the angles of positions 0..T-1 (Hugging Face's rotate_half),
    or of each row's own absolute positions ``pos`` (B, T) (the cached forward), in float32 whatever
    autocast computed x in (as torchtitan and Hugging Face do)."""
    t = x.shape[1]
    if pos is None:
        cos, sin = rope[0, :t].unsqueeze(1), rope[1, :t].unsqueeze(1)   # (T, 1, head_dim): broadcast over heads
    else:
        cos, sin = rope[0][pos].unsqueeze(2), rope[1][pos].unsqueeze(2)   # (B, T, 1, head_dim)
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-b, a], dim=-1) * sin).type_as(x)


class Attention(nn.Module):
    context_parallel = None   # set by the trainer's cp (tandem/train/parallel/cp.py): ring attention while active

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.wq = nn.Linear(c.hidden, c.heads * c.head_dim, bias=c.qkv_bias)
        self.wk = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.wv = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.wo = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.norm_eps) if c.qk_norm else None
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.norm_eps) if c.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)   # local heads under tp
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, rope).transpose(1, 2), rotate(k, rope).transpose(1, 2)
        v = v.transpose(1, 2)
        cp = self.context_parallel
        if cp is not None and cp.active:   # context parallel: the other ranks' keys and values come by ring
            y = cp.attention(q, k, v)
        else:  # grouped-query attention: query head h reads key/value head h // (heads / kv_heads)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def forward_cached(self, x, rope, pos, cache, layer, rows, write_at, mask, comm) -> torch.Tensor:
        """The attention with the KV cache (tandem/models/kvcache.py): keys are cached after their rotation,
        each at its own absolute position."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, rope, pos).transpose(1, 2), rotate(k, rope, pos).transpose(1, 2)
        y = cached_attention(q, k, v.transpose(1, 2), cache, layer, rows, write_at, mask)
        return comm.row(self.wo, y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.hidden, c.ffn, bias=False)   # gate
        self.w3 = nn.Linear(c.hidden, c.ffn, bias=False)   # up
        self.w2 = nn.Linear(c.ffn, c.hidden, bias=False)   # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward_cached(self, x: torch.Tensor, comm) -> torch.Tensor:
        return comm.row(self.w2, F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.mlp = MoE(c) if c.experts else MLP(c)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        # rope by keyword: tp's input hooks (sequence parallel's all-gather) see x alone
        x = x + self.attn(self.attn_norm(x), rope=rope)
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x, rope, pos, cache, layer, rows, write_at, mask, comm) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.attn_norm(x), rope, pos, cache, layer, rows, write_at, mask, comm)
        if isinstance(self.mlp, MoE):   # an MoE stays whole on every tp rank: nothing to reduce
            return x + self.mlp(self.mlp_norm(x))
        return x + self.mlp.forward_cached(self.mlp_norm(x), comm)


def layout(c: LlamaConfig) -> DecoderLayout:
    moe = bool(c.experts)   # a mixture of experts stays whole on every tp rank: tp splits the attention only
    return DecoderLayout(embeddings=("tok_emb",), shared=("rope",),
                         colwise=("attn.wq", "attn.wk", "attn.wv") + (() if moe else ("mlp.w1", "mlp.w3")),
                         rowwise=("attn.wo",) + (() if moe else ("mlp.w2",)), norms=("attn_norm", "mlp_norm"),
                         gathers=("attn",) + (() if moe else ("mlp",)), whole=("mlp",) if moe else (),
                         head_norms=("attn.q_norm", "attn.k_norm") if c.qk_norm else ())


class Llama(nn.Module):
    context_parallel = None   # the trainer's cp: this rank's tokens sit at the positions it gives

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.layout = layout(c)
        self.tok_emb = nn.Embedding(c.vocab, c.hidden)
        self.rope = Rotary(c)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.tok_emb.weight
        self.moe = [b.mlp for b in self.layers.values() if isinstance(b.mlp, MoE)]   # a plain list: no new names
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every tensor from its own generator, seeded by ``torch.initial_seed()`` and its
        name (``tandem/models/init.py``): a shard or a pipeline stage gets the same values."""
        init_weights(self)

    def init_tensor(self, module: nn.Module, name: str, t: torch.Tensor, g: torch.Generator) -> None:
        """N(0, 0.02) (Hugging Face's initializer_range), the residual projections (wo, w2) scaled by
        1/sqrt(2 layers) (GPT-2); norms to 1, biases to 0, the rotary table computed."""
        std = 0.02
        if isinstance(module, Rotary):
            t.copy_(module.table())
        elif isinstance(module, GroupedExperts):
            init_expert(name, t, g, self.config.layers, std)
        elif isinstance(module, nn.RMSNorm):
            t.fill_(1)
        elif t.dim() == 1:
            t.zero_()
        elif name.endswith(("wo.weight", "w2.weight")):
            nn.init.normal_(t, 0.0, std / math.sqrt(2 * self.config.layers), generator=g)
        else:
            nn.init.normal_(t, 0.0, std, generator=g)

    def part_cost(self, part: str) -> float:
        """Forward FLOPs per token of ``embed``, one ``block`` or the ``head``: the pipeline's split weights.
        A block: 2 x its matmul parameters + 2 x seq x heads x head_dim for the causal scores and values."""
        c = self.config
        h, q, kv = c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim
        if part == "block":   # an MoE block: the top_k routed and the shared experts a token runs, the router
            ffn = c.ffn if not c.experts else (c.top_k + c.shared_experts) * (c.expert_ffn or c.ffn)
            return 2 * (2 * h * q + 2 * h * kv + 3 * h * ffn + h * c.experts) + 2 * c.seq * q
        if part == "head":
            return 2 * h * c.vocab
        return 0.0  # embedding lookups are memory reads, no FLOPs

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 on the first stage, hidden states (B, T, H) on later pipeline stages."""
        h = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        rope = self.rope.cache   # each attention takes its first T positions (T is local under sequence parallel)
        cp = getattr(self, "context_parallel", None)   # a pipeline chunk runs this forward too
        if cp is not None and cp.active:   # context parallel: the angles of this rank's chunks' true positions
            rope = rope[:, cp.positions(rope.device)]
        for layer in self.layers.values():
            h = layer(h, rope=rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h

    def forward_cached(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache | None, rows=None,
                       write_at=None, mask=None, comm=None) -> torch.Tensor:
        """Logits (B, T, vocab) of ``tokens`` at absolute positions ``pos`` (B, T), each row's queries and
        keys turned by its own positions' angles, keys and values into ``cache`` (a prefill with
        ``mask=None``, a one-token step under ``mask``, or a packed step with ``write_at`` a ``Packed``: (1, runs,
        vocab), each run's last token; tandem/models/kvcache.py). The whole model only."""
        c = comm or LOCAL
        h = c.embed(self.tok_emb, tokens)
        rope = self.rope.cache
        for i, layer in enumerate(self.layers.values()):
            h = layer.forward_cached(h, rope, pos, cache, i, rows, write_at, mask, c)
        if isinstance(write_at, Packed):   # a packed step: the logits of each run's last token only
            h = h[:, write_at.last]
        return c.head(self, self.norm(h))


def from_spec(m) -> Llama:
    """``model.name = "llama"``: the spec's model fields (``tandem/core/spec.py``)."""
    return Llama(LlamaConfig(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=m.ffn,
                             head_dim=m.head_dim, seq=m.seq, vocab=m.vocab, tied=m.tied, rope_theta=m.rope_theta,
                             rope_scaling=dict(m.rope_scaling), norm_eps=m.norm_eps, qkv_bias=m.qkv_bias,
                             qk_norm=m.qk_norm, experts=m.experts, top_k=m.top_k,
                             shared_experts=m.shared_experts, expert_ffn=m.expert_ffn,
                             capacity_factor=m.capacity_factor, router_aux_loss=m.router_aux_loss,
                             router_z_loss=m.router_z_loss))
