"""Iteration-level (continuous) batching for tandem's decoders (GPT, Llama, MoE Llama): sequences join
the running batch at the next decode step and leave it when done, each in its own KV-cache slot.

``Decoder`` owns the cache: one (slots, kv_heads, seq, head_dim) key and value tensor per block, each
sequence in its own slot. A step is one forward over the new tokens of several sequences packed
together (``Decoder.step``; models/kvcache.py's ``Packed``): the next token of every decoding sequence
and chunks of prompts, nothing padded to the longest. Each token's key and value are written into its
slot in place, and each sequence attends over its own slot's cache up to its own tokens, read where it
lies (no copy of any slot's past), so a row's numbers do not depend on which other sequences share
the step. The forward is the model's own (``model.forward_cached``, tandem/models/kvcache.py), run
against a ``Comm``: ``Local`` calls the model's own layers; a tensor-parallel rank (tp.py) swaps in the
vocabulary-parallel embedding, the all-reduce after the row-parallel projections and the all-gather
of the vocabulary-split logits, and the same decoder then runs on its slices.

``Scheduler`` is the policy on top: which sequences are live, what each step feeds (every decoding
sequence's next token first, then prompt chunks up to ``step_tokens``: vLLM's chunked prefill, so a new
prompt never stalls the running sequences for a whole forward of its own), the per-request pick (temperature,
top_k, seeded generator), when each is finished. It runs on one process (a tp replica's rank 0) and
drives the decoder; replica.py feeds it requests between steps.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import torch

from tandem.models.kvcache import KVCache, Local, Packed, model_positions

__all__ = ["Decoder", "Local", "Scheduler", "Seq"]


STEP_TOKENS = 256   # tokens one step feeds at most: every live sequence's next token, then prompt chunks


class Decoder:
    def __init__(self, model, slots: int, comm=None):
        self.model, self.slots, self.comm = model, slots, comm or Local()
        self.seq = getattr(self.comm, "seq", 0) or model_positions(model)   # tp: a GPT's positions are split
        self.cache = KVCache.empty(model, slots, self.seq)                  # this rank's kv heads under tp

    def forward(self, tokens, pos, rows=None, write_at=None, mask=None):
        """Logits of ``tokens`` at positions ``pos``. With ``rows``: keys and values go into those cache
        slots at ``write_at`` (models/kvcache.py: a slice, per-row positions, or a ``Packed`` step).
        Without: a plain causal forward, nothing cached (predict)."""
        cache = self.cache if rows is not None else None
        return self.model.forward_cached(tokens, pos, cache, rows=rows, write_at=write_at, mask=mask,
                                         comm=self.comm)

    def step(self, runs: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """One forward over ``runs``, each (slot, tokens, start position): a sequence's next token, a whole
        prompt or a chunk of one, packed together (nothing padded); each token's key and value go into
        its slot's cache in place, and each run attends over its slot's cache up to its own tokens
        (models/kvcache.py, ``Packed``). The logits (runs, vocab) of each run's last token."""
        plan = Packed.of([(slot, start, len(toks)) for slot, toks, start in runs])
        tokens = torch.tensor([t for _, toks, _ in runs for t in toks], dtype=torch.long).unsqueeze(0)
        with torch.no_grad():
            logits = self.forward(tokens, plan.pos.unsqueeze(0), plan.slots, plan)
        return logits[0].float()

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """The prompts into their slots (one step); the logits at each prompt's last position."""
        return self.step([(s, list(q), 0) for s, q in zip(slots, prompts)])

    def decode(self, slots: list[int], tokens: list[int], pos: list[int]) -> torch.Tensor:
        """One step: ``tokens[i]`` at position ``pos[i]`` of slot ``slots[i]``; logits (n, vocab)."""
        return self.step([(s, [t], p) for s, t, p in zip(slots, tokens, pos)])

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
    fed: int = 0   # prompt tokens already in the cache (a long prompt is prefilled a chunk a step)

    @property
    def prefilled(self) -> bool:
        return self.fed >= len(self.req["prompt"])

    @property
    def done(self) -> bool:
        return len(self.out) >= int(self.req["max_new_tokens"])


class Scheduler:
    """Live sequences over a decoder's slots. ``add`` queues a request; ``step`` runs one forward of at
    most ``step_tokens`` tokens: the next token of every sequence already decoding, then chunks of the
    prompts still being prefilled and of queued requests, which take free slots in order (the rest wait
    for a slot). So a new prompt is prefilled inside the decode steps, a chunk at a time, instead of in
    a forward of its own that stalls every running sequence. Both return the requests they finished,
    as (id, tokens). A sequence whose forward or pick fails leaves alone, its slot freed, and waits in
    ``failed`` as (id, reason) for the caller to answer; the others go on."""

    def __init__(self, decoder, pick, isolate: bool = True, step_tokens: int = STEP_TOKENS):
        self.dec, self.pick = decoder, pick            # pick(logits, req, generator) -> token
        # a failed forward is run again row by row to find the sequence that breaks it; not under tp,
        # where a failed forward is a rank gone (the replica exits, replica.py)
        self.isolate = isolate
        self.step_tokens = max(1, step_tokens)
        # a min-heap: the lowest free slot first, so that the live rows stay packed at the front of the
        # cache (a step's decode attention reads rows 0..highest live one as one view)
        self.free = list(range(decoder.slots))
        self.live: dict[int, Seq] = {}                 # slot -> sequence (prefilling or decoding)
        self.waiting: deque[Seq] = deque()
        self.failed: list[tuple[object, str]] = []     # (id, reason): taken by take_failed()
        self.steps = 0                                 # steps that decoded a token of a running sequence

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    def add(self, rid, req: dict) -> list[tuple[object, list[int]]]:
        s = Seq(rid, req, torch.Generator().manual_seed(int(req.get("seed", 0))))
        if s.done:
            return [(rid, [])]
        self.waiting.append(s)   # its prompt joins the next step()
        return []

    def held(self) -> dict:
        """{id: tokens decoded so far} of every sequence here, live or waiting for a slot."""
        return {s.rid: len(s.out) for s in [*self.live.values(), *self.waiting]}

    def take_failed(self) -> list[tuple[object, str]]:
        out, self.failed = self.failed, []
        return out

    def _release(self, s: Seq) -> None:
        del self.live[s.slot]
        heapq.heappush(self.free, s.slot)

    def _fail(self, s: Seq, e: Exception) -> None:
        if self.live.get(s.slot) is s:
            self._release(s)
            self.dec.clear(s.slot)
        self.failed.append((s.rid, f"{type(e).__name__}: {str(e)[:300]}"))

    def _next(self, s: Seq, logits, done: list) -> None:
        """``s``'s next token from its logits; finished: out of its slot, into ``done``."""
        try:
            s.out.append(self.pick(logits, s.req, s.gen))
        except Exception as e:   # this sequence's pick: it fails alone
            return self._fail(s, e)
        if s.done:
            self._release(s)
            done.append((s.rid, s.out))

    def _each(self, items: list[tuple[Seq, tuple]]) -> list:
        """The logits rows of one step over ``items`` (sequence, run); if that forward fails, each run
        alone, so that the sequence that breaks it fails alone (a row's numbers do not depend on its
        neighbours, and writing its keys and values again at the same positions is harmless). None for
        a failed row."""
        try:
            return list(self.dec.step([run for _, run in items]))
        except Exception as e:
            if not self.isolate:
                raise
            if len(items) == 1:
                self._fail(items[0][0], e)
                return [None]
        rows = []
        for s, run in items:
            try:
                rows.append(self.dec.step([run])[0])
            except Exception as e:
                self._fail(s, e)
                rows.append(None)
        return rows

    def _plan(self) -> tuple[list, list]:
        """This step's runs: (sequence, (slot, tokens, start)) of every decoding sequence (its last
        token), then of prompt chunks while the step's token budget lasts: sequences part-way through
        their prompt first, then queued requests into free slots (a joining sequence is live, in its
        slot, before the forward runs, so a failure anywhere leaves it visible to cancel and drop_all)."""
        # in slot order: when the decoding rows are slots 0..n-1, their attention reads views (Packed.dense)
        decoding = [(s, (s.slot, [s.out[-1]], len(s.req["prompt"]) + len(s.out) - 1))
                    for _, s in sorted(self.live.items()) if s.prefilled]
        budget = self.step_tokens - len(decoding)
        chunks = []
        for s in [s for s in self.live.values() if not s.prefilled]:
            if budget <= 0:
                break
            n = min(len(s.req["prompt"]) - s.fed, budget)
            chunks.append((s, (s.slot, list(s.req["prompt"][s.fed:s.fed + n]), s.fed)))
            budget -= n
        while self.waiting and self.free and (budget > 0 or not (decoding or chunks)):
            s = self.waiting.popleft()
            s.slot = heapq.heappop(self.free)
            self.live[s.slot] = s
            n = min(len(s.req["prompt"]), max(budget, 1))
            chunks.append((s, (s.slot, list(s.req["prompt"][:n]), 0)))
            budget -= n
        return decoding, chunks

    def step(self) -> list[tuple[object, list[int]]]:
        """One forward: every decoding sequence's next token, and prompt chunks (``_plan``); a prompt
        whose last chunk ran gets its first token; finished sequences leave and free their slots."""
        decoding, chunks = self._plan()
        if not (decoding or chunks):
            return []
        rows = self._each(decoding + chunks)
        if decoding:
            self.steps += 1
        done = []
        for (s, (_, toks, _)), logits in zip(chunks, rows[len(decoding):]):
            if logits is None:
                continue
            s.fed += len(toks)
            if s.prefilled:
                self._next(s, logits, done)
        for (s, _), logits in zip(decoding, rows):
            if logits is not None:
                self._next(s, logits, done)
        return done

    def cancel(self, rid) -> list[tuple[object, list[int]]]:
        """Drop ``rid`` (its client went away, or a stop sequence ended it): its slot is free for the next
        step, which no longer decodes it; [(id, tokens so far)], or [] if it is not here."""
        for s in self.live.values():
            if s.rid == rid:
                self._release(s)
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
            heapq.heappush(self.free, slot)
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
