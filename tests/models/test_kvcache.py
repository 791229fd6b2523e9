"""The decoders' one cached forward (tandem/models/kvcache.py): a ragged batch prefilled together and
decoded a token per row per step, each row at its own absolute position, gives at every step the logits
of the plain forward over that row's whole text, within float tolerance (different kernels and shapes
reach the same sums in another order). For GPT (grouped-query attention, the tanh gelu), Llama
(grouped-query attention, rope_theta, rope_scaling, Qwen's qk_norm and biases) and the MoE Llama; rows
in order (whole-batch decoding) and scattered over a larger cache (continuous batching's slots)."""

from __future__ import annotations

import pytest
import torch

from tandem.models.gpt import GPT, GPTConfig
from tandem.models.kvcache import KVCache, Packed, model_positions, step_mask, supports
from tandem.models.llama import Llama, LlamaConfig

SEQ, VOCAB = 16, 20
CASES = {
    "gpt-gqa-tanh": lambda: GPT(GPTConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq=SEQ, vocab=VOCAB,
                                          gelu="tanh")),
    "llama-gqa-theta": lambda: Llama(LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq=SEQ, vocab=VOCAB,
                                                 rope_theta=500.0)),
    "llama-qwen3-llama3-scaling": lambda: Llama(LlamaConfig(
        layers=2, hidden=32, heads=4, kv_heads=1, head_dim=12, seq=SEQ, vocab=VOCAB, qk_norm=True, qkv_bias=True,
        rope_theta=1e6, rope_scaling={"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 8})),
    "moe-llama": lambda: Llama(LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, seq=SEQ, vocab=VOCAB, experts=4,
                                           top_k=2, shared_experts=1, expert_ffn=16)),
}


def build(case: str):
    torch.manual_seed(0)
    m = CASES[case]().eval()
    with torch.no_grad():   # weights large enough that a wrong position or a wrong row moves the logits
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return m


def check_ragged(model, scattered: bool) -> int:
    """Prefill prompts of 1, 4 and 7 tokens together, then step each row on until the cache is full; every
    row's logits against the plain forward. The number of (row, step) pairs compared."""
    g = torch.Generator().manual_seed(3)
    lens = [1, 4, 7]
    texts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]
    n, p = len(texts), max(lens)
    rows = torch.tensor([3, 0, 2]) if scattered else None     # slots of a 4-slot cache, out of order
    cache = KVCache.empty(model, 4 if scattered else n, model_positions(model))
    tokens = torch.zeros(n, p, dtype=torch.long)
    for i, t in enumerate(texts):
        tokens[i, :len(t)] = torch.tensor(t)
    compared = 0
    with torch.no_grad():
        logits = model.forward_cached(tokens, torch.arange(p).expand(n, p), cache, rows=rows, write_at=slice(0, p))
        last = logits[torch.arange(n), torch.tensor(lens) - 1]
        while True:
            for i, t in enumerate(texts):
                want = model(torch.tensor([t]))[0, -1]
                torch.testing.assert_close(last[i], want, rtol=1e-4, atol=1e-4, msg=f"row {i} at length {len(t)}")
                compared += 1
            if max(len(t) for t in texts) == SEQ:
                return compared
            nxt = torch.randint(0, VOCAB, (n,), generator=g)
            pos = torch.tensor([len(t) for t in texts])
            for i, t in enumerate(texts):
                t.append(int(nxt[i]))
            logits = model.forward_cached(nxt.unsqueeze(1), pos.unsqueeze(1), cache, rows=rows, write_at=pos,
                                          mask=step_mask(pos))
            last = logits[:, 0]


def test_llama_gqa_ragged_rows_in_scattered_slots_match_the_plain_forward():
    model = build("llama-gqa-theta")
    assert supports(model)
    assert check_ragged(model, scattered=True) == 3 * (SEQ - 7 + 1)


@pytest.mark.slow
@pytest.mark.parametrize("scattered", [False, True], ids=["in-order", "scattered"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_logits_match_the_plain_forward(case, scattered):
    assert check_ragged(build(case), scattered) == 3 * (SEQ - 7 + 1)


@pytest.mark.slow
def test_a_model_without_the_cached_forward_is_not_supported():
    assert not supports(torch.nn.Linear(2, 2))
    m = build("gpt-gqa-tanh")
    m.head = None                      # a pipeline stage: not the whole model
    assert not supports(m)


def check_packed(model) -> int:
    """Continuous batching's packed step (``Packed``): rows in scattered slots of a 5-slot cache, each step
    one forward over every row's next run (a 3-token chunk of its prompt while it has one, then one token),
    packed together; the logits of each run's last token against the plain forward over that row's text so
    far. The number of runs compared."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 4, 7, 9)]
    slots, fed = [4, 0, 2, 1], [0] * 4
    texts = [[] for _ in prompts]
    cache = KVCache.empty(model, 5, model_positions(model))
    compared = 0
    with torch.no_grad():
        while max(len(t) for t in texts) < SEQ:
            runs, tokens = [], []
            for i, p in enumerate(prompts):
                new = p[fed[i]:fed[i] + 3] if fed[i] < len(p) else torch.randint(0, VOCAB, (1,), generator=g).tolist()
                if len(texts[i]) + len(new) > SEQ:
                    continue
                fed[i] += len(new) if fed[i] < len(p) else 0
                runs.append((i, len(texts[i]), len(new)))
                texts[i] += new
                tokens += new
            plan = Packed.of([(slots[i], start, n) for i, start, n in runs])
            logits = model.forward_cached(torch.tensor([tokens]), plan.pos.unsqueeze(0), cache, rows=plan.slots,
                                          write_at=plan)
            assert logits.shape[:2] == (1, len(runs))
            for k, (i, start, n) in enumerate(runs):
                want = model(torch.tensor([texts[i]]))[0, -1]
                torch.testing.assert_close(logits[0, k], want, rtol=1e-4, atol=1e-4,
                                           msg=f"row {i} at length {len(texts[i])}")
                compared += 1
    return compared


def test_gpt_gqa_packed_steps_match_the_plain_forward():
    assert check_packed(build("gpt-gqa-tanh")) > 4 * 6


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_steps_match_the_plain_forward(case):
    assert check_packed(build(case)) > 4 * 6
