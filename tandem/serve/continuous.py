"""Iteration-level (continuous) batching for tandem's GPT: sequences join the running batch at the next
decode step and leave it when done, each in its own KV-cache slot.

``Decoder`` owns the cache: one (slots, kv_heads, seq, head_dim) key and value tensor per block. A new
sequence is prefilled alone into a free slot; a decode step feeds one token for every live slot at
that slot's own position and attends over that slot's cached past only (a mask per row), so a row's
numbers do not depend on which other sequences share the step. The forward is written against a
``Comm``: ``Local`` calls the model's own layers; a tensor-parallel rank (tp.py) swaps in the
vocabulary-parallel embedding, the all-reduce after the row-parallel projections and the all-gather
of the vocabulary-split logits, and the same decoder then runs on its slices.

``Scheduler`` is the policy on top: which sequences are live, the per-request pick (temperature,
top_k, seeded generator), when each is finished. It runs on one process (a tp replica's rank 0) and
drives the decoder; replica.py feeds it requests between steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.serve.kvcache import _attend, _heads


class Local:
    """A whole model on one process."""

    def embed(self, emb, idx):
        return emb(idx)

    def row(self, lin, x):
        return lin(x)

    def head(self, model, h):
        return model.head(h)


class Decoder:
    def __init__(self, model, slots: int, comm=None):
        self.model, self.slots, self.comm = model, slots, comm or Local()
        blk0 = next(iter(model.layers.values()))
        d = blk0.attn.head_dim
        kv = blk0.attn.wk.out_features // d        # this rank's kv heads under tp
        self.seq = getattr(self.comm, "seq", 0) or int(model.pos_emb.weight.shape[0])   # tp: positions split
        dt = model.tok_emb.weight.dtype
        self.cache = [(torch.zeros(slots, kv, self.seq, d, dtype=dt), torch.zeros(slots, kv, self.seq, d, dtype=dt))
                      for _ in model.layers]

    def forward(self, tokens, pos, rows=None, write_at=None, mask=None):
        """Logits (B, T, vocab) of ``tokens`` at positions ``pos``. With ``rows``: keys and values go
        into those cache slots at ``write_at`` (a slice: the prefill, causal over the new tokens; or
        per-row positions: a step, attending over the slot's cache under ``mask``). Without: a plain
        causal forward, nothing cached (predict)."""
        c, m = self.comm, self.model
        h = c.embed(m.tok_emb, tokens) + c.embed(m.pos_emb, pos)
        for (ck, cv), blk in zip(self.cache, m.layers.values()):
            a, x = blk.attn, blk.ln1(h)
            q, k, v = _heads(a.wq(x), a.head_dim), _heads(a.wk(x), a.head_dim), _heads(a.wv(x), a.head_dim)
            if mask is None:
                if rows is not None:
                    ck[rows, :, write_at], cv[rows, :, write_at] = k, v
                y = _attend(q, k, v, None)
            else:
                ck[rows, :, write_at], cv[rows, :, write_at] = k[:, :, 0], v[:, :, 0]
                width = mask.shape[-1]
                y = _attend(q, ck[rows, :, :width], cv[rows, :, :width], mask)
            h = h + c.row(a.wo, y.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))
            mlp = blk.mlp
            h = h + c.row(mlp.w2, F.gelu(mlp.w1(blk.ln2(h))))
        return c.head(m, m.norm(h))

    def prefill(self, slot: int, prompt: list[int]) -> torch.Tensor:
        """The prompt into ``slot``; the logits at its last position."""
        p = len(prompt)
        with torch.no_grad():
            logits = self.forward(torch.tensor([prompt]), torch.arange(p).unsqueeze(0), torch.tensor([slot]),
                                  slice(0, p))
        return logits[0, -1].float()

    def decode(self, slots: list[int], tokens: list[int], pos: list[int]) -> torch.Tensor:
        """One step: ``tokens[i]`` at position ``pos[i]`` of slot ``slots[i]``; logits (n, vocab)."""
        p = torch.tensor(pos)
        width = int(p.max()) + 1
        mask = (torch.arange(width).unsqueeze(0) <= p.unsqueeze(1)).view(len(slots), 1, 1, width)
        with torch.no_grad():
            logits = self.forward(torch.tensor(tokens).unsqueeze(1), p.unsqueeze(1), torch.tensor(slots), p, mask)
        return logits[:, 0].float()

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """A plain forward (B, T) -> (B, T, vocab), nothing cached."""
        b, t = tokens.shape
        with torch.no_grad():
            return self.forward(tokens, torch.arange(t).expand(b, t))


@dataclass
class Seq:
    rid: object
    req: dict
    gen: torch.Generator
    slot: int = -1
    out: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.out) >= int(self.req["max_new_tokens"])


class Scheduler:
    """Live sequences over a decoder's slots. ``add`` and ``step`` return the requests they finished,
    as (id, tokens); a request waits (in order) while every slot is taken."""

    def __init__(self, decoder, pick):
        self.dec, self.pick = decoder, pick            # pick(logits, req, generator) -> token
        self.free = list(range(decoder.slots))[::-1]
        self.live: dict[int, Seq] = {}                 # slot -> sequence
        self.waiting: deque[Seq] = deque()
        self.steps = 0

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    def add(self, rid, req: dict) -> list[tuple[object, list[int]]]:
        s = Seq(rid, req, torch.Generator().manual_seed(int(req.get("seed", 0))))
        if s.done:
            return [(rid, [])]
        self.waiting.append(s)
        return self._admit()

    def _admit(self) -> list[tuple[object, list[int]]]:
        done = []
        while self.waiting and self.free:
            s = self.waiting.popleft()
            s.slot = self.free.pop()
            s.out.append(self.pick(self.dec.prefill(s.slot, s.req["prompt"]), s.req, s.gen))
            if s.done:
                self.free.append(s.slot)
                done.append((s.rid, s.out))
            else:
                self.live[s.slot] = s
        return done

    def step(self) -> list[tuple[object, list[int]]]:
        """One decode step over every live sequence; then waiting ones take the freed slots."""
        if not self.live:
            return self._admit()
        seqs = list(self.live.values())
        logits = self.dec.decode([s.slot for s in seqs], [s.out[-1] for s in seqs],
                                 [len(s.req["prompt"]) + len(s.out) - 1 for s in seqs])
        self.steps += 1
        done = []
        for row, s in enumerate(seqs):
            s.out.append(self.pick(logits[row], s.req, s.gen))
            if s.done:
                del self.live[s.slot]
                self.free.append(s.slot)
                done.append((s.rid, s.out))
        return done + self._admit()

    def drop_all(self) -> list:
        """Forget every sequence (after a failed step); their ids."""
        ids = [s.rid for s in self.live.values()] + [s.rid for s in self.waiting]
        self.free.extend(self.live)
        self.live.clear()
        self.waiting.clear()
        return ids

    def run(self, reqs: list[dict]) -> list[list[int]]:
        """Whole requests to the end (the static op, and tests)."""
        out: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            out.update(self.add(i, r))
        while self.busy:
            out.update(self.step())
        return [out[i] for i in range(len(reqs))]
