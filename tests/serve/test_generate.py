"""`tandem generate`'s sampling (tandem/serve/generate.py ``sample``) decodes with the model's KV cache and
gives the tokens of the uncached path (a whole forward over the last seq tokens per token): greedy and
seeded sampling, for GPT and Llama, a text that stays inside seq and one whose window slides past it."""

from __future__ import annotations

import pytest
import torch

from tandem.models.gpt import GPT, GPTConfig
from tandem.models.kvcache import supports
from tandem.models.llama import Llama, LlamaConfig
from tandem.serve.generate import sample

SEQ, VOCAB = 16, 24
MODELS = {
    "gpt": lambda: GPT(GPTConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq=SEQ, vocab=VOCAB)),
    "llama": lambda: Llama(LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq=SEQ, vocab=VOCAB,
                                       rope_theta=500.0)),
}


def build(name: str):
    torch.manual_seed(0)
    m = MODELS[name]().eval()
    with torch.no_grad():   # logits far apart: a near tie cannot make the two paths pick differently
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return m


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("prompt,n", [(3, 10), (5, 30)], ids=["inside-seq", "window-slides"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cached_sampling_gives_the_uncached_tokens(name, prompt, n, temperature):
    model = build(name)
    assert supports(model)   # the cached path is the one under test
    ids = torch.randint(0, VOCAB, (prompt,), generator=torch.Generator().manual_seed(prompt)).tolist()
    cached = sample(model, ids, n, SEQ, temperature, seed=7)
    assert len(cached) == n
    assert cached == sample(model, ids, n, SEQ, temperature, seed=7, cache=False)
