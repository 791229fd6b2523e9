"""The mixture of experts (tandem/models/moe.py) against a per-token reference written here, in one process.

Slow-marked though fast: the quick subset keeps one MoE test (test_expert.py's refusals)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tandem.core.experts import capacity
from tandem.models.llama import Llama, LlamaConfig
from tandem.models.moe import MoE, router_loss

pytestmark = pytest.mark.slow


def _moe(**kw) -> MoE:
    c = LlamaConfig(layers=1, hidden=8, heads=2, seq=8, vocab=16, ffn=16, experts=4, top_k=2, expert_ffn=6, **kw)
    torch.manual_seed(0)
    m = MoE(c)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    return m


def reference(m: MoE, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, int]:
    """Token by token: its top_k experts by router probability, weights renormalised; an assignment past an
    expert's capacity (first choices first, then second, each in token order) is dropped."""
    xf = x.reshape(-1, x.shape[-1])
    n, e, k = xf.shape[0], m.experts_n, m.top_k
    probs = (xf @ m.router.weight.t()).softmax(-1)
    w, idx = probs.topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    cap = capacity(n, k, e, m.factor) if train else int(counts.max())
    used, keep = [0] * e, torch.zeros(n, k, dtype=torch.bool)
    for slot in range(k):
        for t in range(n):
            ex = int(idx[t, slot])
            if used[ex] < cap:
                used[ex] += 1
                keep[t, slot] = True
    out = torch.zeros_like(xf)
    g = m.experts
    for t in range(n):
        for slot in range(k):
            if keep[t, slot]:
                ex = int(idx[t, slot])
                h = F.silu(xf[t] @ g.w1[ex]) * (xf[t] @ g.w3[ex])
                out[t] += w[t, slot] * (h @ g.w2[ex])
    if m.shared is not None:
        out = out + m.shared(xf)
    return out.view_as(x), int((~keep).sum())


@pytest.mark.parametrize("factor, shared", [(1.0, 0), (0.5, 1), (2.0, 0)])
def test_routing_matches_the_per_token_reference(factor, shared):
    m = _moe(capacity_factor=factor, shared_experts=shared)
    x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1))
    m.train()
    y = m(x)
    ref, dropped = reference(m, x, train=True)
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5), (y - ref).abs().max()
    assert m.dropped == dropped and m.assigned == 24 * 2 and int(m.routed.sum()) == 48
    if factor == 0.5:   # 24 tokens x 2 / 4 experts x 0.5 = 6 slots each: at least half the assignments drop
        assert dropped >= 24
    if factor == 2.0:   # 24 slots per expert for 48 assignments: a drop needs one expert over half of them
        assert dropped == max(0, max(m.routed.tolist()) - capacity(24, 2, 4, 2.0))
    m.eval()   # evaluation drops nothing: each token's output is its own, whatever the batch
    y_eval = m(x)
    ref_eval, dropped_eval = reference(m, x, train=False)
    assert dropped_eval == 0 and torch.allclose(y_eval, ref_eval, atol=1e-5, rtol=1e-5)
    assert torch.allclose(m(x[:1]), y_eval[:1], atol=1e-6)


def test_router_losses_are_switch_and_st_moe():
    m = _moe(capacity_factor=1.25, router_aux_loss=0.01, router_z_loss=0.001)
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(2))
    m.train()
    m(x)
    logits = x.reshape(-1, 8) @ m.router.weight.t()
    probs = logits.softmax(-1)
    frac = torch.bincount(probs.topk(2, -1).indices.reshape(-1), minlength=4).float() / (16 * 2)
    want = 0.01 * 4 * (frac * probs.mean(0)).sum() + 0.001 * logits.logsumexp(-1).pow(2).mean()
    assert torch.allclose(m.aux, want, rtol=1e-5)
    # balanced routing with uniform probabilities gives the Switch loss its minimum, 1 x coefficient
    assert math.isclose(float(4 * (torch.full((4,), 0.25) * torch.full((4,), 0.25)).sum()), 1.0)


def test_the_decoder_adds_its_blocks_router_losses_once():
    c = LlamaConfig(layers=2, hidden=16, heads=2, seq=8, vocab=16, ffn=32, experts=4, top_k=1)
    model = Llama(c)
    model(torch.randint(0, 16, (2, 8)))
    got = router_loss(model)
    assert got is not None and got.requires_grad and float(got.detach()) > 0
    assert router_loss(model) is None   # consumed: an evaluation forward cannot leak into the next loss
    dense = Llama(LlamaConfig(layers=2, hidden=16, heads=2, seq=8, vocab=16, ffn=32))
    dense(torch.randint(0, 16, (2, 8)))
    assert router_loss(dense) is None
