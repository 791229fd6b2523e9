"""Continuous batching, in process on the exported GPT: a short request that joins while a long one is
decoding leaves first (counted in decode steps, not time), and every request's tokens equal running it
alone: greedy ones equal the plain loop on `tandem.export.load`, seeded sampled ones equal themselves alone."""

from __future__ import annotations

import random

import torch

import tandem.export
from serve.serve_helpers import greedy
from tandem.serve.continuous import Decoder, Scheduler
from tandem.serve.replica import _pick


def _sched(model, slots=4):
    return Scheduler(Decoder(model, slots), lambda logits, req, gen: _pick(torch, logits, req, gen))


def test_a_short_request_joins_the_running_batch_and_leaves_first(gpt_export):
    model = tandem.export.load(gpt_export)
    s = _sched(model)
    long_ = {"prompt": [3], "max_new_tokens": 16, "temperature": 0.0}
    short = {"prompt": [5, 1, 2], "max_new_tokens": 2, "temperature": 0.0}
    events = []
    assert s.add("long", long_) == []
    for _ in range(3):                          # prefill (token 1), then 2 decode steps
        events += s.step()
    assert s.add("short", short) == [] and list(s.waiting)[0].rid == "short"
    events += s.step()                          # "short" joins (prefill) while "long" decodes its 4th token
    assert sorted(q.rid for q in s.live.values()) == ["long", "short"] and s.steps == 3
    while s.busy:
        events += [(rid, toks, s.steps) for rid, toks in s.step()]
    order = [e[0] for e in events]
    assert order == ["short", "long"], events
    assert events[0][2] == 4 and events[1][2] == 15   # short left after 1 step (its 2nd token), long ran on
    assert events[0][1] == greedy(model, short["prompt"], 2)
    assert events[1][1] == greedy(model, long_["prompt"], 16)


def test_joined_outputs_equal_each_request_alone(gpt_export):
    model = tandem.export.load(gpt_export)
    rng = random.Random(4)
    reqs = []
    for _ in range(9):
        n = rng.randrange(1, 17)
        reqs.append({"prompt": [rng.randrange(16) for _ in range(n)], "max_new_tokens": rng.randrange(0, 18 - n),
                     "temperature": rng.choice([0.0, 1.3]), "top_k": rng.choice([0, 5]), "seed": rng.randrange(99)})
    alone = [_sched(model).run([r]) [0] for r in reqs]
    s, got, i = _sched(model, slots=3), {}, 0   # fewer slots than requests: some wait for a free slot
    while i < len(reqs) or s.busy:
        if i < len(reqs):                        # one new request per step, joining mid-flight
            got.update(s.add(i, reqs[i]))
            i += 1
        got.update(s.step())
    assert [got[k] for k in range(len(reqs))] == alone
    for r, out in zip(reqs, alone):
        if r["temperature"] == 0:
            assert out == greedy(model, r["prompt"], r["max_new_tokens"])
