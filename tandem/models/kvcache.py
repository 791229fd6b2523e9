"""The KV cache of tandem's decoders (gpt.py, llama.py and its MoE blocks), and the attention over it.

Each decoder owns one cached forward, ``model.forward_cached(tokens, pos, cache, ...)``, that serving
(tandem/serve/continuous.py), batch decoding (tandem/serve/kvcache.py) and ``tandem generate`` all call:

    cache = KVCache.empty(model, slots=4, size=model_positions(model))
    logits = model.forward_cached(prompt, pos, cache, rows=slots, write_at=slice(0, T))    # prefill
    logits = model.forward_cached(tok, pos, cache, rows=slots, write_at=pos[:, 0], mask=m)  # one step

Two calls, one forward:

- prefill (``mask=None``): tokens (B, T) at positions ``pos`` (B, T), causal over the T new tokens
  only (the prompts start at position 0); their keys and values go into the cache rows ``rows`` at
  ``write_at`` (a slice). Right-padded rows are fine: causal attention keeps the padding out of each
  prompt, and what it writes past a prompt's end is overwritten by that row's next steps before anything
  reads it.
- step (``mask`` (B, 1, 1, W)): one token per row (T = 1) at that row's own position ``write_at`` (B,);
  its key and value are written there, and it attends over the first W cached positions of its row under
  ``mask`` (True: may attend), so a row sees its own past only and its numbers do not depend on which
  other rows share the step.

``cache=None`` is a plain causal forward, nothing cached. ``comm`` is where tensor parallelism enters
(tandem/serve/tp.py's TPComm): the embedding lookups, the row-parallel projections (attention out, MLP
down) and the output layer go through it; ``Local`` runs the model's own layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class Local:
    """A whole model on one process: the layers as they are."""

    def embed(self, emb, idx):
        return emb(idx)

    def row(self, lin, x):
        return lin(x)

    def head(self, model, h):
        return model.head(h)


LOCAL = Local()


@dataclass
class KVCache:
    """One key and one value tensor per block, each (rows, kv_heads, size, head_dim)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def empty(cls, model, slots: int, size: int) -> "KVCache":
        """Zeros for ``slots`` rows of ``size`` positions, in the model's dtype; the kv head count is read
        from the weights, so under tensor parallelism it is this rank's share."""
        blk0 = next(iter(model.layers.values()))
        d = blk0.attn.head_dim
        kv = blk0.attn.wk.weight.shape[0] // d
        dt = model.tok_emb.weight.dtype

        def zeros():
            return [torch.zeros(slots, kv, size, d, dtype=dt) for _ in model.layers]

        return cls(zeros(), zeros())

    def __iter__(self):
        """(keys, values) of each block, in order."""
        return iter(zip(self.keys, self.values))

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def size(self) -> int:
        return self.keys[0].shape[2]


def model_positions(model) -> int:
    """How many positions the model has (its ``seq``): GPT's learned table or Llama's rotary table."""
    if getattr(model, "pos_emb", None) is not None:
        return int(model.pos_emb.weight.shape[0])
    return int(model.rope.cache.shape[1])


def supports(model) -> bool:
    """True for a whole (not pipeline-split) decoder that owns a cached forward (tandem's GPT, Llama, MoE
    Llama); a user factory's model is decoded without the cache."""
    if not callable(getattr(model, "forward_cached", None)):
        return False
    return all(getattr(model, p, None) is not None for p in ("tok_emb", "layers", "norm", "head"))


def attend(q, k, v, mask=None):
    """q (B, heads, T, D) over k, v (B, kv_heads, S, D): causal when ``mask`` is None, else under it."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves heads/kv_heads queries
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def cached_attention(q, k, v, cache: KVCache | None, layer: int, rows, write_at, mask):
    """Attention of one block with the cache (module docstring): q, k, v (B, heads, T, D), k and v of the
    new tokens only."""
    if cache is None:
        return attend(q, k, v)
    ck, cv = cache.keys[layer], cache.values[layer]
    if mask is None:   # prefill
        r = slice(None) if rows is None else rows
        ck[r, :, write_at], cv[r, :, write_at] = k, v
        return attend(q, k, v)
    # a step: (row, position) pairs index the cache; reading all rows in order is a view, not a copy
    idx = torch.arange(q.shape[0]) if rows is None else rows
    ck[idx, :, write_at], cv[idx, :, write_at] = k[:, :, 0], v[:, :, 0]
    width = mask.shape[-1]
    if rows is None:
        return attend(q, ck[:, :, :width], cv[:, :, :width], mask)
    return attend(q, ck[rows, :, :width], cv[rows, :, :width], mask)


def step_mask(pos: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, W) with W = max(pos) + 1: row i may attend to positions 0..pos[i]."""
    width = int(pos.max()) + 1
    return (torch.arange(width).unsqueeze(0) <= pos.unsqueeze(1)).view(len(pos), 1, 1, width)
