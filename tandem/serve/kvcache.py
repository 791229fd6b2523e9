"""Decoding with a KV cache for tandem's GPT (the layout of tandem/models/gpt.py, as
``tandem.export.load`` returns it): the prompt is run once (prefill), then each step feeds one new
token per sequence and attends over the cached keys and values, instead of recomputing the whole
prefix at every step. Rows keep their own lengths: a row's token goes at its own position, and a mask
keeps every row to its own past. A model of another layout is decoded without the cache (replica.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(model) -> bool:
    """True for a whole (not pipeline-split) tandem GPT whose blocks have the expected parts."""
    parts = ("tok_emb", "pos_emb", "layers", "norm", "head")
    if not all(getattr(model, p, None) is not None for p in parts):
        return False
    return all(all(hasattr(b, p) for p in ("ln1", "attn", "ln2", "mlp")) and
               all(hasattr(b.attn, p) for p in ("wq", "wk", "wv", "wo", "head_dim"))
               for b in model.layers.values())


def _heads(x: torch.Tensor, d: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, -1, d).transpose(1, 2)          # (B, heads, T, D)


def _attend(q, k, v, mask):
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves heads/kv_heads queries
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _forward(model, tokens, pos, cache, mask, write_at):
    """tokens (B, T) at positions pos (B, T); keys and values written into ``cache`` at ``write_at``
    (a slice for the prefill, per-row indices for a step); attention over the cache under ``mask``
    (None: causal over the T new tokens, the prefill)."""
    h = model.tok_emb(tokens) + model.pos_emb(pos)
    rows = torch.arange(tokens.shape[0])
    for (ck, cv), blk in zip(cache, model.layers.values()):
        a, x = blk.attn, blk.ln1(h)
        q, k, v = _heads(a.wq(x), a.head_dim), _heads(a.wk(x), a.head_dim), _heads(a.wv(x), a.head_dim)
        if mask is None:
            ck[:, :, write_at], cv[:, :, write_at] = k, v
            y = _attend(q, k, v, None)
        else:
            ck[rows, :, write_at], cv[rows, :, write_at] = k[:, :, 0], v[:, :, 0]
            width = mask.shape[-1]
            y = _attend(q, ck[:, :, :width], cv[:, :, :width], mask)
        h = h + a.wo(y.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))
        h = h + blk.mlp(blk.ln2(h))
    return model.head(model.norm(h))


def generate(model, reqs: list[dict], pick) -> list[list[int]]:
    """Each request's new tokens; ``pick(logits, i)`` chooses row i's next token from its logits."""
    n = len(reqs)
    lens = torch.tensor([len(r["prompt"]) for r in reqs])
    want = [int(r["max_new_tokens"]) for r in reqs]
    out: list[list[int]] = [[] for _ in reqs]
    if not any(want):
        return out
    p = int(lens.max())
    size = max(int(lens[i]) + want[i] for i in range(n))
    tokens = torch.zeros(n, p, dtype=torch.long)
    for i, r in enumerate(reqs):
        tokens[i, :len(r["prompt"])] = torch.tensor(r["prompt"])
    blk0 = next(iter(model.layers.values()))
    kv = blk0.attn.wk.out_features // blk0.attn.head_dim
    dt = model.tok_emb.weight.dtype
    cache = [(torch.zeros(n, kv, size, blk0.attn.head_dim, dtype=dt),
              torch.zeros(n, kv, size, blk0.attn.head_dim, dtype=dt)) for _ in model.layers]
    with torch.no_grad():
        logits = _forward(model, tokens, torch.arange(p).expand(n, p), cache, None, slice(0, p))
        last = logits[torch.arange(n), lens - 1].float()
        cur = lens.clone()                     # where each row's next token goes
        seq = model.pos_emb.num_embeddings
        while True:
            nxt = torch.zeros(n, dtype=torch.long)
            for i in range(n):
                if len(out[i]) < want[i]:
                    nxt[i] = pick(last[i], i)
                    out[i].append(int(nxt[i]))
            live = [i for i in range(n) if len(out[i]) < want[i]]
            if not live:
                return out
            # rows already done are carried along (their outputs ignored), at a position kept in range
            pos = torch.clamp(cur, max=min(seq, size) - 1)
            width = int(pos.max()) + 1
            mask = (torch.arange(width).unsqueeze(0) <= pos.unsqueeze(1)).view(n, 1, 1, width)
            logits = _forward(model, nxt.unsqueeze(1), pos.unsqueeze(1), cache, mask, pos)
            last = logits[:, 0].float()
            cur = cur + 1
