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

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """The prompts into their slots, in one forward (right-padded: causal attention keeps the
        padding out of each prompt, and what it writes past a prompt's end is overwritten by that
        slot's next steps before anything reads it); the logits at each prompt's last position."""
        n, p = len(prompts), max(len(q) for q in prompts)
        tokens = torch.zeros(n, p, dtype=torch.long)
        for i, q in enumerate(prompts):
            tokens[i, :len(q)] = torch.tensor(q)
        with torch.no_grad():
            logits = self.forward(tokens, torch.arange(p).expand(n, p), torch.tensor(slots), slice(0, p))
        return logits[torch.arange(n), torch.tensor([len(q) for q in prompts]) - 1].float()

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
    """Live sequences over a decoder's slots. ``add`` queues a request; ``step`` admits the queued
    ones into free slots (in order; the rest wait for a slot) and decodes; both return the requests
    they finished, as (id, tokens)."""

    def __init__(self, decoder, pick):
        self.dec, self.pick = decoder, pick            # pick(logits, req, generator) -> token
        self.free = list(range(decoder.slots))[::-1]
        self.live: dict[int, Seq] = {}                 # slot -> sequence
        self.waiting: deque[Seq] = deque()
        self._pending: list = []                       # finished in the step under way
        self.steps = 0

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    def add(self, rid, req: dict) -> list[tuple[object, list[int]]]:
        s = Seq(rid, req, torch.Generator().manual_seed(int(req.get("seed", 0))))
        if s.done:
            return [(rid, [])]
        self.waiting.append(s)   # prefilled with the others that arrive before the next step()
        return []

    def _admit(self) -> list[tuple[object, list[int]]]:
        """Waiting requests into free slots, prefilled together; each gets its first token."""
        joining = []
        while self.waiting and self.free:
            s = self.waiting.popleft()
            s.slot = self.free.pop()
            joining.append(s)
        if not joining:
            return []
        logits = self.dec.prefill([s.slot for s in joining], [s.req["prompt"] for s in joining])
        done = []
        for row, s in enumerate(joining):
            s.out.append(self.pick(logits[row], s.req, s.gen))
            if s.done:
                self.free.append(s.slot)
                done.append((s.rid, s.out))
            else:
                self.live[s.slot] = s
        return done

    def step(self) -> list[tuple[object, list[int]]]:
        """Waiting requests join (one prefill for all of them, their first token), then one decode
        step over every sequence that was already live; finished ones leave and free their slots."""
        seqs = list(self.live.values())
        done = self._admit()
        if not seqs:
            return done
        logits = self.dec.decode([s.slot for s in seqs], [s.out[-1] for s in seqs],
                                 [len(s.req["prompt"]) + len(s.out) - 1 for s in seqs])
        self.steps += 1
        for row, s in enumerate(seqs):
            s.out.append(self.pick(logits[row], s.req, s.gen))
            if s.done:
                del self.live[s.slot]
                self.free.append(s.slot)
                done.append((s.rid, s.out))
        return done

    def cancel(self, rid) -> list[tuple[object, list[int]]]:
        """Drop ``rid`` (its client went away, or a stop sequence ended it): its slot is free for the next
        step, which no longer decodes it; [(id, tokens so far)], or [] if it is not here."""
        for slot, s in self.live.items():
            if s.rid == rid:
                del self.live[slot]
                self.free.append(slot)
                return [(rid, s.out)]
        for s in self.waiting:
            if s.rid == rid:
                self.waiting.remove(s)
                return [(rid, s.out)]
        return []

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
