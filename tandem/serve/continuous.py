"""Iteration-level (continuous) batching for tandem's decoders (GPT, Llama, MoE Llama): sequences join
the running batch at the next decode step and leave it when done, each in its own KV-cache slot.

``Decoder`` owns the cache: one (slots, kv_heads, seq, head_dim) key and value tensor per block. A new
sequence is prefilled alone into a free slot; a decode step feeds one token for every live slot at
that slot's own position and attends over that slot's cached past only (a mask per row), so a row's
numbers do not depend on which other sequences share the step. The forward is the model's own
(``model.forward_cached``, tandem/models/kvcache.py), run against a
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

from tandem.models.kvcache import KVCache, Local, model_positions, step_mask

__all__ = ["Decoder", "Local", "Scheduler", "Seq"]


class Decoder:
    def __init__(self, model, slots: int, comm=None):
        self.model, self.slots, self.comm = model, slots, comm or Local()
        self.seq = getattr(self.comm, "seq", 0) or model_positions(model)   # tp: a GPT's positions are split
        self.cache = KVCache.empty(model, slots, self.seq)                  # this rank's kv heads under tp

    def forward(self, tokens, pos, rows=None, write_at=None, mask=None):
        """Logits (B, T, vocab) of ``tokens`` at positions ``pos``. With ``rows``: keys and values go
        into those cache slots at ``write_at`` (a slice: the prefill, causal over the new tokens; or
        per-row positions: a step, attending over the slot's cache under ``mask``). Without: a plain
        causal forward, nothing cached (predict)."""
        cache = self.cache if rows is not None else None
        return self.model.forward_cached(tokens, pos, cache, rows=rows, write_at=write_at, mask=mask,
                                         comm=self.comm)

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
        with torch.no_grad():
            logits = self.forward(torch.tensor(tokens).unsqueeze(1), p.unsqueeze(1), torch.tensor(slots), p,
                                  step_mask(p))
        return logits[:, 0].float()

    def clear(self, slot: int) -> None:
        """Zero a slot's cache (a sequence failed in it): a step reads a slot past its own position, with
        weight 0, and 0 x NaN left by a sequence whose numbers blew up would be NaN for the next one."""
        for ck, cv in self.cache:
            ck[slot].zero_()
            cv[slot].zero_()

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
    they finished, as (id, tokens). A sequence whose prefill, decode or pick fails leaves alone, its
    slot freed, and waits in ``failed`` as (id, reason) for the caller to answer; the others go on."""

    def __init__(self, decoder, pick, isolate: bool = True):
        self.dec, self.pick = decoder, pick            # pick(logits, req, generator) -> token
        # a failed forward is run again row by row to find the sequence that breaks it; not under tp,
        # where a failed forward is a rank gone (the replica exits, replica.py)
        self.isolate = isolate
        self.free = list(range(decoder.slots))[::-1]
        self.live: dict[int, Seq] = {}                 # slot -> sequence
        self.waiting: deque[Seq] = deque()
        self.failed: list[tuple[object, str]] = []     # (id, reason): taken by take_failed()
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

    def held(self) -> dict:
        """{id: tokens decoded so far} of every sequence here, live or waiting for a slot."""
        return {s.rid: len(s.out) for s in [*self.live.values(), *self.waiting]}

    def take_failed(self) -> list[tuple[object, str]]:
        out, self.failed = self.failed, []
        return out

    def _fail(self, s: Seq, e: Exception) -> None:
        if self.live.get(s.slot) is s:
            del self.live[s.slot]
            self.dec.clear(s.slot)
            self.free.append(s.slot)
        self.failed.append((s.rid, f"{type(e).__name__}: {str(e)[:300]}"))

    def _next(self, s: Seq, logits, done: list) -> None:
        """``s``'s next token from its logits; finished: out of its slot, into ``done``."""
        try:
            s.out.append(self.pick(logits, s.req, s.gen))
        except Exception as e:   # this sequence's pick: it fails alone
            return self._fail(s, e)
        if s.done:
            del self.live[s.slot]
            self.free.append(s.slot)
            done.append((s.rid, s.out))

    def _each(self, seqs: list[Seq], batched, alone) -> list:
        """``batched(seqs)``'s logits rows; if that forward fails, each sequence's own (``alone(s)``), so that
        the one that breaks it fails alone (a row's numbers do not depend on its neighbours, and
        writing its keys and values again at the same positions is harmless). None for a failed row."""
        try:
            return list(batched(seqs))
        except Exception:
            if len(seqs) == 1 or not self.isolate:
                raise
        rows = []
        for s in seqs:
            try:
                rows.append(alone(s)[0])
            except Exception as e:
                self._fail(s, e)
                rows.append(None)
        return rows

    def _admit(self) -> list[tuple[object, list[int]]]:
        """Waiting requests into free slots, prefilled together; each gets its first token. A joining
        sequence is live (in its slot) before the prefill runs, so a failure anywhere leaves it visible
        to cancel and drop_all."""
        joining = []
        while self.waiting and self.free:
            s = self.waiting.popleft()
            s.slot = self.free.pop()
            self.live[s.slot] = s
            joining.append(s)
        if not joining:
            return []
        try:
            rows = self._each(joining, lambda ss: self.dec.prefill([s.slot for s in ss], [s.req["prompt"] for s in ss]),
                              lambda s: self.dec.prefill([s.slot], [s.req["prompt"]]))
        except Exception as e:
            if not self.isolate:
                raise
            rows = [None] * len(joining)
            self._fail(joining[0], e)
        done = []
        for s, logits in zip(joining, rows):
            if logits is not None:
                self._next(s, logits, done)
        return done

    def _decode(self, seqs: list[Seq]):
        return self.dec.decode([s.slot for s in seqs], [s.out[-1] for s in seqs],
                               [len(s.req["prompt"]) + len(s.out) - 1 for s in seqs])

    def step(self) -> list[tuple[object, list[int]]]:
        """Waiting requests join (one prefill for all of them, their first token), then one decode
        step over every sequence that was already live; finished ones leave and free their slots."""
        seqs = list(self.live.values())
        done = self._admit()
        if not seqs:
            return done
        try:
            rows = self._each(seqs, self._decode, lambda s: self._decode([s]))
        except Exception as e:   # the only sequence: it fails alone
            if not self.isolate:
                raise
            rows = [None]
            self._fail(seqs[0], e)
        self.steps += 1
        for s, logits in zip(seqs, rows):
            if logits is not None:
                self._next(s, logits, done)
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
        for slot in self.live:
            self.dec.clear(slot)
        self.free.extend(self.live)
        self.live.clear()
        self.waiting.clear()
        return ids + [rid for rid, _ in self.take_failed()]

    def run(self, reqs: list[dict]) -> list[list[int]]:
        """Whole requests to the end (the static op, and tests)."""
        out: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            out.update(self.add(i, r))
        while self.busy:
            out.update(self.step())
        if self.failed:
            raise RuntimeError("; ".join(f"request {i}: {why}" for i, why in self.take_failed()))
        return [out[i] for i in range(len(reqs))]
