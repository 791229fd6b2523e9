"""The KV cache of tandem's decoders (gpt.py, llama.py and its MoE blocks), and the attention over it.

Each decoder owns one cached forward, ``model.forward_cached(tokens, pos, cache, ...)``, that serving
(tandem/serve/continuous.py), batch decoding (tandem/serve/kvcache.py) and ``tandem generate`` all call:

    cache = KVCache.empty(model, slots=4, size=model_positions(model))
    logits = model.forward_cached(prompt, pos, cache, rows=slots, write_at=slice(0, T))    # prefill
    logits = model.forward_cached(tok, pos, cache, rows=slots, write_at=pos[:, 0], mask=m)  # one step
    plan = Packed.of([(slot, start, n), ...])                                               # a packed step
    logits = model.forward_cached(toks, plan.pos[None], cache, rows=plan.slots, write_at=plan)

Three calls, one forward:

- prefill (``mask=None``): tokens (B, T) at positions ``pos`` (B, T), causal over the T new tokens
  only (the prompts start at position 0); their keys and values go into the cache rows ``rows`` at
  ``write_at`` (a slice). Right-padded rows are fine: causal attention keeps the padding out of each
  prompt, and what it writes past a prompt's end is overwritten by that row's next steps before anything
  reads it.
- step (``mask`` (B, 1, 1, W)): one token per row (T = 1) at that row's own position ``write_at`` (B,);
  its key and value are written there, and it attends over the first W cached positions of its row under
  ``mask`` (True: may attend), so a row sees its own past only and its numbers do not depend on which
  other rows share the step.

- packed (``write_at`` a ``Packed``): the new tokens of several rows in one sequence, tokens and ``pos``
  (1, N), each row's run of tokens at its own positions (a whole prompt, a chunk of one, or the one token
  of a decode step). Every token's key and value go into its row's cache in place; each run attends over
  its row's cache up to its own tokens, read where it lies (a view, no copy): the one-token runs
  together, one attention call over the rows they occupy, each under its own length; a longer run (a
  prompt, or a chunk of one) causally over its row's earlier positions and its own. The logits returned
  are those of each run's last token only, (1, runs, vocab). This is continuous batching's step
  (tandem/serve/continuous.py): prompts prefilled inside decode steps, nothing padded to the longest.

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


@dataclass
class Packed:
    """Where the N packed tokens of a step go and what each attends over (the module docstring): built once
    per step by ``Packed.of`` and read by every block."""

    slots: torch.Tensor        # (N,) each token's cache row
    pos: torch.Tensor          # (N,) each token's position
    last: torch.Tensor         # (runs,) index of each run's last token: its logits are returned
    one: torch.Tensor          # token indices of the one-token runs
    one_rows: torch.Tensor     # their cache rows (distinct)
    rows_hi: int               # the one-token runs attend over cache rows 0..rows_hi-1 (a view)
    width: int                 # ... and positions 0..W-1 of them
    one_mask: torch.Tensor | None   # (rows_hi, 1, 1, W): row r's run sees positions 0..its own (None: all W)
    long: list[tuple[int, int, int, int]]   # (first token, length, row, start position) of longer runs
    dense: bool = False        # the one-token runs come first, in rows 0..rows_hi-1 in order: no scatter

    @classmethod
    def of(cls, runs: list[tuple[int, int, int]]) -> "Packed":
        """``runs``: (cache row, start position, token count), in the order their tokens are packed."""
        slots, pos, last, one, one_rows, one_pos, long = [], [], [], [], [], [], []
        at = 0
        for row, start, n in runs:
            slots += [row] * n
            pos += range(start, start + n)
            if n == 1:
                one.append(at)
                one_rows.append(row)
                one_pos.append(start)
            else:
                long.append((at, n, row, start))
            at += n
            last.append(at - 1)
        mask, hi, width, dense = None, 0, 0, False
        if one:
            hi = max(one_rows) + 1
            dense = one_rows == list(range(hi)) and one == list(range(hi))
            # rows of 0..hi-1 with no one-token run attend to position 0 (a result nobody reads; a row
            # that sees no position at all would be NaN)
            upto = torch.zeros(hi, dtype=torch.long)
            upto[torch.tensor(one_rows)] = torch.tensor(one_pos)
            width = int(upto.max()) + 1
            mask = (torch.arange(width).unsqueeze(0) <= upto.unsqueeze(1)).view(hi, 1, 1, width)
            if dense and min(one_pos) == width - 1:   # every row sees all W positions: no mask to apply
                mask = None
        t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return cls(t(slots), t(pos), t(last), t(one), t(one_rows), hi, width, mask, long, dense)

    @property
    def tokens(self) -> int:
        return len(self.slots)


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
    if isinstance(write_at, Packed):
        return packed_attention(q, k, v, cache, layer, write_at)
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


def packed_attention(q, k, v, cache: KVCache, layer: int, p: Packed):
    """One block's attention over a packed step (``Packed``): q, k, v (1, heads, N, D) of the new tokens."""
    ck, cv = cache.keys[layer], cache.values[layer]
    ck[p.slots, :, p.pos], cv[p.slots, :, p.pos] = k[0].transpose(0, 1), v[0].transpose(0, 1)   # in place
    gqa = k.shape[1] != q.shape[1]
    y = torch.empty_like(q)
    if len(p.one):
        # the one-token runs, each at its row of the cache; the rows they occupy are read as one view
        # (rows 0..rows_hi-1, positions 0..W-1): no copy of any row's past
        hi, w = p.rows_hi, p.width
        if p.dense:   # tokens 0..hi-1 are rows 0..hi-1's: views, nothing scattered
            qd = q[0, :, :hi].transpose(0, 1).unsqueeze(2)
        else:
            qd = q.new_zeros(hi, q.shape[1], 1, q.shape[3])
            qd[p.one_rows] = q[0, :, p.one].transpose(0, 1).unsqueeze(2)
        yd = F.scaled_dot_product_attention(qd, ck[:hi, :, :w], cv[:hi, :, :w], attn_mask=p.one_mask,
                                            enable_gqa=gqa)
        if p.dense:
            y[0, :, :hi] = yd[:, :, 0].transpose(0, 1)
        else:
            y[0, :, p.one] = yd[p.one_rows, :, 0].transpose(0, 1)
    for at, n, row, start in p.long:   # a prompt or a chunk of one: its row's earlier positions, and causal
        qs = q[:, :, at:at + n]
        ks, vs = ck[row:row + 1, :, :start + n], cv[row:row + 1, :, :start + n]
        if start == 0:
            ys = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        else:
            m = torch.arange(start + n).unsqueeze(0) <= (start + torch.arange(n)).unsqueeze(1)
            ys = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, enable_gqa=gqa)
        y[:, :, at:at + n] = ys
    return y


def step_mask(pos: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, W) with W = max(pos) + 1: row i may attend to positions 0..pos[i]."""
    width = int(pos.max()) + 1
    return (torch.arange(width).unsqueeze(0) <= pos.unsqueeze(1)).view(len(pos), 1, 1, width)
