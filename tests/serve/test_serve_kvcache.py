"""Decoding with the KV cache gives the tokens of decoding without it, in process on the exported GPT:
greedy equal to the plain one-sequence loop, and ragged batches (prompt lengths, token counts, seeded
sampling mixed) equal to the replica's no-cache batched decoding."""

from __future__ import annotations

import random

import torch

import tandem.export
from serve.serve_helpers import greedy
from tandem.serve import kvcache
from tandem.serve.replica import generate, generate_cached


def test_cached_greedy_equals_the_plain_loop(gpt_export):
    model = tandem.export.load(gpt_export)
    assert kvcache.supports(model)
    rng = random.Random(1)
    prompts = [[rng.randrange(16) for _ in range(n)] for n in (1, 5, 8, 16)]
    reqs = [{"prompt": p, "max_new_tokens": 17 - len(p), "temperature": 0.0} for p in prompts]
    assert generate_cached(model, torch, reqs) == [greedy(model, p, 17 - len(p)) for p in prompts]


def test_cached_ragged_batches_equal_uncached(gpt_export):
    model = tandem.export.load(gpt_export)
    rng = random.Random(2)
    for _ in range(12):
        reqs = []
        for _ in range(rng.randrange(1, 7)):
            n = rng.randrange(1, 17)
            reqs.append({"prompt": [rng.randrange(16) for _ in range(n)], "max_new_tokens": rng.randrange(0, 18 - n),
                         "temperature": rng.choice([0.0, 1.3]), "top_k": rng.choice([0, 5]),
                         "seed": rng.randrange(100)})
        assert generate_cached(model, torch, reqs) == generate(model, torch, reqs), reqs


def test_a_model_of_another_layout_is_not_cached(resnet_export):
    assert not kvcache.supports(tandem.export.load(resnet_export))
