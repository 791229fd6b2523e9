"""Expert and context parallelism (tandem/plan/moe_cp.py): published parameter counts, hand arithmetic.

Published figures:
- Mixtral 8x7B: 46.7B parameters in all, 12.9B used per token (Mistral AI, "Mixtral of experts", 2023-12-11,
  and Jiang et al. 2024, arXiv:2401.04088, section 2: "47B parameters ... 13B active parameters").
- DeepSeek-V3: 671B parameters in all, 37B activated per token (DeepSeek-AI 2024, arXiv:2412.19437, abstract;
  shape from its section 4.2: 61 layers, hidden 7168, MLA with 128 heads, q/kv ranks 1536/512, 1 shared +
  256 routed experts of inner size 2048, top 8, the first 3 layers dense with 18432).
"""

import pytest

from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.terms.memory import gpt_layer_act_bytes
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.model import DEEPSEEK_V3, MIXTRAL_8X7B, MoEShape, expert_params, fwd_flops_per_token, moe_params
from tandem.plan.terms.context import cp_comm, cp_shape, min_chunk_for_overlap
from tandem.plan.terms.expert import all_to_all, ep_comm
from tandem.plan.terms.memory import states_per_gpu


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


def test_expert_parallel_states_per_gpu():
    """Mixtral on 8 GPUs, ep 8, ZeRO-1, bf16 Adam: each GPU holds one expert per layer, the rest whole."""
    m = MIXTRAL_8X7B
    by = {"param": 2, "grad": 2}
    st = states_per_gpu(m, tp=1, pp=1, ep=8, dp=8, zero=1, by=by, optimizer_bytes=12)
    experts = expert_params(m)
    rest = moe_params(m) - experts
    assert st["expert_params_per_gpu"] == experts / 8 and st["dense_params_per_gpu"] == rest
    assert st["params"] == pytest.approx(2 * (experts / 8 + rest))
    # the expert-data-parallel group is dp / ep = 1: its optimizer state is not sharded further
    assert st["optimizer"] == pytest.approx(12 * (experts / 8 + rest / 8))
    with pytest.raises(ValueError):
        states_per_gpu(m, tp=1, pp=1, ep=3, dp=8, zero=1, by=by, optimizer_bytes=12)


def test_all_to_all_inside_and_across_nodes():
    c = make_cluster("h100-sxm", 8, 4, inter="ib-ndr", nics_per_node=8)
    S = 64e6
    assert all_to_all(S, 8, 8, c) == pytest.approx(S * 7 / 8 / 370e9 + 7 * 3e-6)
    # ep 32 over 4 nodes: 7/32 of the bytes on NVLink (370 GB/s achievable), 24/32 through the GPU's NIC (48 GB/s)
    assert all_to_all(S, 32, 8, c) == pytest.approx(S * 7 / 32 / 370e9 + S * 24 / 32 / 48e9 + 31 * 5e-6)
    r = ep_comm(MIXTRAL_8X7B, micro_batch=1, cp=1, ep=8, act_bytes=2, c=c)
    assert r["bytes_per_call"] == 4096 * 2 * 1.0 * 4096 * 2 and r["calls"] == 4 * 32


def test_context_parallel_activations_and_ring_overlap():
    g = GPTShape(layers=32, hidden=4096, heads=32, kv_heads=8, seq=32768, vocab=32000, gated=True, bias=False,
                 norm="rmsnorm", tied=False, learned_pos=False)
    t = Training(global_batch=8, precision="bf16")
    s = Strategy(dp=1, micro_batch=1, recompute="selective")
    full = gpt_layer_act_bytes(gpt_stats(g), s, t, 1)
    quarter = gpt_layer_act_bytes(gpt_stats(cp_shape(g, 4)), s, t, 1)
    assert quarter == pytest.approx(full / 4)           # flash-style attention: linear in the tokens held
    c = make_cluster("h100-sxm", 8, 1)
    rate = 989.4e12 * 0.5
    chunk = min_chunk_for_overlap(g, 2, rate, 450e9)
    assert chunk == pytest.approx(rate * 1024 * 2 / (2 * 4096 * 450e9))   # ~275 tokens on H100 NVLink
    r = cp_comm(g, 1, 4, 2, rate, c)
    assert r["bytes_per_step"] == 2 * 8192 * 1024 * 2 and r["steps"] == 3 * 32
    assert r["exposed_s"] == 0.0 and r["time_s"] > 0   # 8192 tokens a GPU >> 275: hidden behind attention
    slow = cp_comm(g, 1, 4, 2, rate, make_cluster("h100-sxm", 1, 4, inter="eth-10"), crosses_nodes=True)
    assert slow["exposed_s"] > 0                        # across 10 GbE it is not
    with pytest.raises(ValueError):
        cp_shape(g, 5)
