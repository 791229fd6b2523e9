"""A GPT-style decoder sized by its shape, laid out for tensor and pipeline parallelism.

    model = GPT(GPTConfig(layers=4, hidden=64, heads=4, kv_heads=2, seq=16, vocab=16))
    logits = model(tokens)          # (B, T) int64 -> (B, T, vocab)

Layout (torchtitan style): ``tok_emb``, ``pos_emb`` (learned positions), ``layers`` (a
ModuleDict "0".."L-1" of pre-norm blocks, so a pipeline stage deletes the blocks it does
not own and keeps the names of the rest), ``norm`` and ``head``. Each of them may be
``None`` on a pipeline stage. Attention computes its local head count from the weight
shapes, so the same code runs with the projections split column-wise across tp ranks.
With ``tied=True`` the output layer shares the token embedding matrix (GPT-2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.errors import ConfigError
from tandem.models.init import init_weights
from tandem.models.kvcache import LOCAL, KVCache, Packed, cached_attention
from tandem.models.layout import DecoderLayout

GELU = {"exact": "none", "tanh": "tanh"}   # model.gelu -> F.gelu's approximate=

# what the parallel strategies cut (tandem/models/layout.py)
LAYOUT = DecoderLayout(embeddings=("tok_emb", "pos_emb"), colwise=("attn.wq", "attn.wk", "attn.wv", "mlp.w1"),
                       rowwise=("attn.wo", "mlp.w2"), norms=("ln1", "ln2"), gathers=("attn", "mlp"))


@dataclass
class GPTConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 0      # 0: same as heads (multi-head); fewer: grouped-query attention
    ffn: int = 0           # 0: 4 * hidden
    seq: int = 16
    vocab: int = 16
    tied: bool = True
    gelu: str = "exact"        # exact (erf) | tanh (the tanh approximation: GPT-2's gelu_new)

    def __post_init__(self):
        if self.gelu not in GELU:
            raise ConfigError(f"gelu {self.gelu!r} is not one of {', '.join(GELU)}", field="model.gelu",
                              value=self.gelu, fix="use exact or tanh")
        self.kv_heads = self.kv_heads or self.heads
        self.ffn = self.ffn or 4 * self.hidden
        for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab"):
            if getattr(self, k) < 1:
                raise ConfigError(f"must be at least 1, got {getattr(self, k)}", field=f"model.{k}",
                                  value=getattr(self, k), fix="give a positive size")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads} "
                              f"({self.hidden} % {self.heads} = {self.hidden % self.heads})", field="model.heads",
                              value=self.heads, fix="choose heads that divide hidden")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}",
                              field="model.kv_heads", value=self.kv_heads, fix="choose kv_heads that divide heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Attention(nn.Module):
    context_parallel = None   # set by the trainer's cp (tandem/train/parallel/cp.py): ring attention while active

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.wq = nn.Linear(c.hidden, c.heads * c.head_dim)
        self.wk = nn.Linear(c.hidden, c.kv_heads * c.head_dim)
        self.wv = nn.Linear(c.hidden, c.kv_heads * c.head_dim)
        self.wo = nn.Linear(c.heads * c.head_dim, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)   # local heads under tp
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cp = self.context_parallel
        if cp is not None and cp.active:   # context parallel: the other ranks' keys and values come by ring
            return self.wo(cp.attention(q, k, v).transpose(1, 2).reshape(b, t, -1))
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves heads/kv_heads queries
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def forward_cached(self, x, cache, layer, rows, write_at, mask, comm) -> torch.Tensor:
        """The attention with the KV cache (tandem/models/kvcache.py)."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = cached_attention(q, k, v, cache, layer, rows, write_at, mask)
        return comm.row(self.wo, y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(c.hidden, c.ffn)
        self.w2 = nn.Linear(c.ffn, c.hidden)
        self.approximate = GELU[c.gelu]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate=self.approximate))

    def forward_cached(self, x: torch.Tensor, comm) -> torch.Tensor:
        return comm.row(self.w2, F.gelu(self.w1(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.hidden)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.hidden)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward_cached(self, x, cache, layer, rows, write_at, mask, comm) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.ln1(x), cache, layer, rows, write_at, mask, comm)
        return x + self.mlp.forward_cached(self.ln2(x), comm)


class GPT(nn.Module):
    layout = LAYOUT
    context_parallel = None   # the trainer's cp: this rank's tokens sit at the positions it gives

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok_emb = nn.Embedding(c.vocab, c.hidden)
        self.pos_emb = nn.Embedding(c.seq, c.hidden)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every tensor from its own generator, seeded by ``torch.initial_seed()`` and its
        name (``tandem/models/init.py``): a shard or a pipeline stage gets the same values."""
        init_weights(self)

    def init_tensor(self, module: nn.Module, name: str, t: torch.Tensor, g: torch.Generator) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 layers);
        layer norms to identity, biases to zero."""
        std = 0.02
        if t.dim() == 1:
            t.fill_(1 if isinstance(module, nn.LayerNorm) and name.endswith("weight") else 0)
        elif name.endswith(("wo.weight", "w2.weight")):
            nn.init.normal_(t, 0.0, std / math.sqrt(2 * self.config.layers), generator=g)
        else:
            nn.init.normal_(t, 0.0, std, generator=g)

    def part_cost(self, part: str) -> float:
        """Forward FLOPs per token of ``embed``, one ``block`` or the ``head``: the pipeline's split weights."""
        return block_cost(self.config, part)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 on the first stage, hidden states (B, T, H) on later pipeline stages."""
        h = tokens
        if self.tok_emb is not None:
            cp = getattr(self, "context_parallel", None)   # a pipeline chunk runs this forward too
            pos = (cp.positions(tokens.device) if cp is not None and cp.active   # cp: this rank's chunks' positions
                   else torch.arange(tokens.shape[1], device=tokens.device)).unsqueeze(0)
            h = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h

    def forward_cached(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache | None, rows=None,
                       write_at=None, mask=None, comm=None) -> torch.Tensor:
        """Logits (B, T, vocab) of ``tokens`` at absolute positions ``pos`` (B, T), keys and values into
        ``cache`` (a prefill with ``mask=None``, a one-token step under ``mask``, or a packed step with
        ``write_at`` a ``Packed``: (1, runs, vocab), each run's last token; tandem/models/kvcache.py).
        The whole model only (not a pipeline stage); the trainer's context parallel plays no part."""
        c = comm or LOCAL
        h = c.embed(self.tok_emb, tokens) + c.embed(self.pos_emb, pos)
        for i, layer in enumerate(self.layers.values()):
            h = layer.forward_cached(h, cache, i, rows, write_at, mask, c)
        if isinstance(write_at, Packed):   # a packed step: the logits of each run's last token only
            h = h[:, write_at.last]
        return c.head(self, self.norm(h))


def gpt(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 0, ffn: int = 0, seq: int = 16,
        vocab: int = 16, tied: bool = True, gelu: str = "exact", **_ignored) -> GPT:
    """Factory (``model.name = "gpt"``); extra keywords (num_classes, in_channels) are ignored."""
    return GPT(GPTConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, seq=seq,
                         vocab=vocab, tied=tied, gelu=gelu))


def block_cost(c: GPTConfig, part: str) -> float:
    """Forward FLOPs per token of one part (``embed``, ``block``, ``head``): the weights for the
    pipeline's balanced split. A block: 2 x its matmul parameters + 4 x seq x hidden for attention
    scores and values (causal halves it: 2 x seq x hidden)."""
    h, kv = c.hidden, c.kv_heads * c.head_dim
    if part == "block":
        return 2 * (2 * h * h + 2 * h * kv + 2 * h * c.ffn) + 2 * c.seq * h
    if part == "head":
        return 2 * h * c.vocab
    return 0.0  # embedding lookups are memory reads, no FLOPs
