"""MoE shapes (tandem/plan/inputs/model.py): published parameter counts, hand arithmetic.

Published figures:
- Mixtral 8x7B: 46.7B parameters in all, 12.9B used per token (Mistral AI, "Mixtral of experts", 2023-12-11,
  and Jiang et al. 2024, arXiv:2401.04088, section 2: "47B parameters ... 13B active parameters").
- DeepSeek-V3: 671B parameters in all, 37B activated per token (DeepSeek-AI 2024, arXiv:2412.19437, abstract;
  shape from its section 4.2: 61 layers, hidden 7168, MLA with 128 heads, q/kv ranks 1536/512, 1 shared +
  256 routed experts of inner size 2048, top 8, the first 3 layers dense with 18432).
"""

import pytest

from tandem.plan.inputs.model import DEEPSEEK_V3, MIXTRAL_8X7B, GPTShape, MoEShape, fwd_flops_per_token, moe_params


def test_mixtral_parameters_as_published():
    m = MIXTRAL_8X7B
    assert moe_params(m) == pytest.approx(46.7e9, rel=0.005)
    assert moe_params(m, active=True) == pytest.approx(12.9e9, rel=0.005)


def test_deepseek_v3_parameters_as_published():
    m = DEEPSEEK_V3
    assert moe_params(m) == pytest.approx(671e9, rel=0.01)
    assert moe_params(m, active=True) == pytest.approx(37e9, rel=0.03)


def test_one_expert_is_the_dense_model_plus_its_router():
    g = GPTShape(layers=4, hidden=256, heads=4, seq=128, vocab=1000, gated=True, bias=False, norm="rmsnorm")
    m = MoEShape(g, experts=1, top_k=1, expert_ffn=g.ffn)
    assert moe_params(m) == g.params() + 4 * 256
    assert fwd_flops_per_token(m) == pytest.approx(g.layers * g.layer_fwd_flops_per_token()
                                                      + g.logits_fwd_flops_per_token() + 2 * 4 * 256)
