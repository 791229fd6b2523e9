"""Whole-batch decoding with a KV cache, over the cached forward tandem's decoders own
(``model.forward_cached``, tandem/models/kvcache.py: GPT, Llama, MoE Llama): the prompts are run once
(prefill), then each step feeds one new token per sequence and attends over the cached keys and values,
instead of recomputing the whole prefix at every step. Rows keep their own lengths: a row's token goes
at its own position, and a mask keeps every row to its own past. A model without that forward (a user
factory's) is decoded without the cache (replica.py).
"""

from __future__ import annotations

import torch

from tandem.models.kvcache import KVCache, model_positions, step_mask, supports

__all__ = ["generate", "supports"]


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
    cache = KVCache.empty(model, n, size)
    with torch.no_grad():
        logits = model.forward_cached(tokens, torch.arange(p).expand(n, p), cache, write_at=slice(0, p))
        last = logits[torch.arange(n), lens - 1].float()
        cur = lens.clone()                     # where each row's next token goes
        seq = model_positions(model)
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
            logits = model.forward_cached(nxt.unsqueeze(1), pos.unsqueeze(1), cache, write_at=pos,
                                          mask=step_mask(pos))
            last = logits[:, 0].float()
            cur = cur + 1
