"""Decoding with the KV cache gives the tokens of decoding without it, in process on the exported GPT:
greedy equal to the plain one-sequence loop, and ragged batches (prompt lengths, token counts, seeded
sampling mixed) equal to the replica's no-cache batched decoding; the same for a Llama export, in process
and through a real `tandem serve`."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tandem.export
from serve.serve_helpers import Server, greedy
from tandem.serve import kvcache
from tandem.serve.continuous import Decoder, Scheduler
from tandem.serve.replica import _pick, generate, generate_cached


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


@pytest.mark.slow
def test_llama_export_decodes_with_the_cache_and_its_tokens(llama_export):
    """A Llama export (GQA, rope_theta) is decoded with the cache now: whole batches and continuous
    batching give the uncached decoder's tokens."""
    model = tandem.export.load(llama_export)
    assert kvcache.supports(model)
    rng = random.Random(5)
    for _ in range(6):
        reqs = []
        for _ in range(rng.randrange(1, 6)):
            n = rng.randrange(1, 17)
            reqs.append({"prompt": [rng.randrange(16) for _ in range(n)], "max_new_tokens": rng.randrange(0, 18 - n),
                         "temperature": rng.choice([0.0, 1.3]), "seed": rng.randrange(100)})
        plain = generate(model, torch, reqs)
        assert generate_cached(model, torch, reqs) == plain, reqs
        sched = Scheduler(Decoder(model, 3), lambda logits, req, gen: _pick(torch, logits, req, gen))
        assert sched.run(reqs) == plain, reqs


@pytest.mark.slow
def test_served_llama_greedy_equals_the_uncached_forward(llama_export, tmp_path):
    """A real `tandem serve` of the Llama export (continuous batching over the cached forward): every
    request's greedy tokens equal the plain uncached loop on the loaded export."""
    model = tandem.export.load(llama_export)
    assert kvcache.supports(model)   # what replica.py asks before it decodes with the cache
    rng = random.Random(6)
    prompts = [[rng.randrange(16) for _ in range(n)] for n in (1, 3, 6, 9, 12)]
    news = [15, 9, 10, 7, 4]
    with Server(llama_export, tmp_path / "serve", "--replicas", "1", "--max-batch", "4") as srv:
        with ThreadPoolExecutor(len(prompts)) as ex:   # together: they share decode steps
            got = list(ex.map(lambda i: srv.client.post("/v1/generate", json={
                "prompt": prompts[i], "max_new_tokens": news[i]}), range(len(prompts))))
    assert [r.status_code for r in got] == [200] * len(prompts), [r.text for r in got]
    assert [r.json()["tokens"] for r in got] == [greedy(model, p, k) for p, k in zip(prompts, news)]
