"""Context parallelism, ring attention as the frameworks run it (tandem/plan/terms/context.py, attention_kernels.py):
kernel speed on the ring's blocks, torch's all-gather rotation, fp32 dK/dV and merges, against hand arithmetic."""

import math
from dataclasses import replace

import pytest

from tandem.plan.cost import check_cp_ep, evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.attention_kernels import speed, train_speed
from tandem.plan.terms.context import (block_length, cp_comm, cp_shape, diagonal_fraction, kv_width, merge_s,
                                      min_chunk_for_overlap)
from tandem.plan.terms.efficiency import block_share
from tandem.plan.terms.memory import gpt_layer_act_bytes

LLAMA3_8B = GPTShape(layers=32, hidden=4096, heads=32, kv_heads=8, seq=262144, vocab=128256, ffn=14336,
                     gated=True, bias=False, norm="rmsnorm", tied=False, learned_pos=False)


def test_kernel_speed_follows_the_flashattention3_figure():
    # Shah et al. 2024, forward, head dim 128, H100 SXM5: FA3 467 (512) ... 648 (16k); cuDNN peaks at 2k
    assert speed("fa3", 512) == 467 and speed("fa3", 16384) == 648 and speed("fa3", 1 << 20) == 648
    assert speed("fa2", 3 * 1024) == pytest.approx(362 + (368 - 362) * (math.log2(3072) - 11))
    # Megatron/TE (cuDNN) at cp 2 of 8192 tokens: blocks of 8192 / (2 sqrt 2) = 2896 tokens
    # forward + backward (backward 2.5 F in the paper): 3 / (1/fwd + 2.5/bwd); cuDNN at 8k: 600 and 518
    assert train_speed("cudnn", 8192) == pytest.approx(3 / (1 / 600 + 2.5 / 518))
    assert block_share("h100-sxm", "megatron", 8192, 2) == pytest.approx(
        train_speed("cudnn", 2896.3) / train_speed("cudnn", 8192), rel=1e-3)
    assert block_share("h100-sxm", "torch", 262144, 8) == 1.0          # clamped at the figure's 16k
    # the A100's FlashAttention-2 follows the same kernel's H100 curve by length (efficiency.py); B200: no figure
    assert block_share("a100-80gb", "torch", 8192, 8) == pytest.approx(
        train_speed("fa2", 8192 / (8 * 2 ** 0.5)) / train_speed("fa2", 8192))
    assert block_share("b200", "torch", 8192, 8) == 1.0
    assert block_share("h100-sxm", "megatron", 8192, 1) == 1.0


def test_kv_bytes_and_block_flops_are_per_gpu_under_tp():
    g = LLAMA3_8B
    assert kv_width(g, 1) == 1024 and kv_width(g, 4) == 256 and kv_width(g, 16) == 128   # 8 kv heads
    c = make_cluster("h100-sxm", 8, 1)
    one, four = (cp_comm(g, 1, 2, 2, 400e12, c, tp=t) for t in (1, 4))
    assert four["bytes_per_step"] == one["bytes_per_step"] / 4 and four["block_f"] == one["block_f"] / 4


def test_torch_all_gather_rotation_is_hidden_only_behind_the_first_block():
    """Across 10 GbE the all-gather outlasts the first block: exposed = layers x (passes x (AG - f) + (AG - b)
    + (cp-1) x max(0, dKV - b) + dKV), AG = (cp-1) x (kv/B + alpha), dKV = 2 kv/B + alpha (fp32): cp sends of
    dK, dV backward, the last waited for after the loop (torch's _templated_ring_attention_backward)."""
    g = GPTShape(layers=2, hidden=4096, heads=32, kv_heads=8, seq=16384, vocab=32000, gated=True, bias=False,
                 norm="rmsnorm", tied=False, learned_pos=False)
    c = make_cluster("h100-sxm", 1, 4, inter="eth-10")
    rate = 400e12
    r = cp_comm(g, 1, 4, 2, rate, c, crosses_nodes=True, fwd_passes=2, impl="torch")
    B, a = c.node_rate_Bps / c.gpus_per_node, c.inter.latency_s
    kv = 2 * 4096 * 1024 * 2
    ag, dkv = 3 * (kv / B + a), 2 * kv / B + a
    f = 4 * 4096 * 4096 * 4096 / rate
    assert r["send_f"] == pytest.approx(ag) and r["send_b"] == pytest.approx(dkv)
    want = 2 * (2 * max(0, ag - f) + max(0, ag - 2 * f) + 3 * max(0, dkv - 2 * f) + dkv)
    assert r["exposed_s"] == pytest.approx(want) and r["exposed_s"] > 0
    assert r["time_s"] == pytest.approx(2 * (3 * ag + 4 * dkv))
    # on NVLink every send hides behind its block but the last dK/dV one: layers x dKV exposed
    nv = cp_comm(g, 1, 4, 2, rate, make_cluster("h100-sxm", 4, 1), impl="torch")
    assert nv["exposed_s"] == pytest.approx(2 * nv["send_b"])


def test_torch_merges_cost_hbm_time_and_slow_the_cp_rows():
    """(cp-1) x layers x micro-batches x (passes x (42 B q + 4 B kv) + 16 B q + 26 B kv) / HBM bandwidth."""
    m = gpt_stats(LLAMA3_8B)
    c = make_cluster("h100-sxm", 8, 1)
    s = Strategy(dp=1, cp=8, zero=3, micro_batch=1, recompute="full")
    q, kv = 32768 * 4096, 2 * 32768 * 1024
    want = 7 * 32 * (2 * (42 * q + 4 * kv) + 16 * q + 26 * kv) / c.gpu.memory_Bps
    assert merge_s(m.gpt, s, 32, 1, c.gpu.memory_Bps) == pytest.approx(want)
    t = dict(global_batch=1, precision="fp8", attention_kernel="fa2")   # torch's ring runs SDPA's flash kernel
    torch = evaluate(m, c, Training(cp_impl="torch", **t), s)
    mega = evaluate(m, c, Training(**t), s)
    assert torch.cp_merge_s == pytest.approx(want) and mega.cp_merge_s == 0.0
    assert torch.compute_s == pytest.approx(mega.compute_s + want)
    assert 0.01 < want / torch.step_s < 0.05    # 1-5% of a 262k-token step: not what the published rows miss


def test_the_diagonal_step_runs_at_the_causal_speed():
    """1/cp of the ring's FLOPs are the diagonal step's causal block on s/cp tokens (torch's step i = 0, TE's step 0),
    the rest unmasked blocks of s/(cp sqrt 2): attention time = F x (1/cp / causal share(s/cp) + (cp-1)/cp /
    ring share(block)), forward (1 + rc) F and backward 2 F apart; Meta's all-gather CP has no diagonal step."""
    from tandem.plan.terms import efficiency as E

    assert diagonal_fraction(4, "torch") == diagonal_fraction(4, "megatron") == 0.25
    assert diagonal_fraction(4, "allgather") == 0.0 and diagonal_fraction(1, "torch") == 0.0
    m, c = gpt_stats(LLAMA3_8B), make_cluster("h100-sxm", 8, 1)
    s = Strategy(dp=2, cp=4, zero=3, micro_batch=1)
    t = Training(global_batch=2, precision="bf16", attention_kernel="fa2", cp_impl="torch")
    flops = 1e15
    ring = E.kernel_shares("h100-sxm", "fa2", block_length(262144, 4), True)
    diag = E.kernel_shares("h100-sxm", "fa2", 65536, False)
    peak = c.flops_ref("bf16")
    want = sum(w * (flops / (peak * sh[0]) + 2 * flops / (peak * sh[1])) for w, sh in ((0.75, ring), (0.25, diag)))
    got, k = E.attention_times(c, t, s, flops, 0, 0.0, 0.5, block_length(262144, 4), 65536)
    assert k == "fa2" and got == pytest.approx(want)
    # FlashAttention-2's causal forward at 16k is 335 against 370 unmasked (FlashAttention-3 paper): slower
    assert got > E.attention_times(c, t, s, flops, 0, 0.0, 0.5, block_length(262144, 4))[0] * 1.02


def test_allgather_cp_exposes_its_gather_and_scatter():
    """Llama 3 §3.3.2: K/V all-gathered per layer, "exposed in the critical path"; dK/dV reduce-scattered back:
    exposed = time = layers x (passes x AG(cp x kv) + RS(cp x kv)), collectives.collective's times over the cp group."""
    from tandem.plan.terms.collectives import collective, layout

    g = replace(LLAMA3_8B, layers=4)
    c = make_cluster("h100-sxm", 8, 2)
    r = cp_comm(g, 1, 16, 2, 400e12, c, crosses_nodes=True, fwd_passes=2, tp=1, impl="allgather")
    kv = 2 * (262144 // 16) * 1024 * 2
    grp = layout(16, 1, 8)
    ag, rs = collective("all_gather", 16 * kv, 1, grp, c)[0], collective("reduce_scatter", 16 * kv, 1, grp, c)[0]
    assert r["bytes_per_step"] == kv and r["send_f"] == ag and r["send_b"] == rs
    assert r["exposed_s"] == r["time_s"] == pytest.approx(4 * (2 * ag + rs))


def test_kv_repeated_to_the_query_heads_moves_and_merges_h_over_tp():
    """torchtitan's Llama (Dec 2024) repeats K/V to the 32 query heads before SDPA: torch's ring moves h/tp values
    a token instead of kv_dim / min(tp, kv heads): 4x for Llama 3 8B, 16 heads of 128 under tp 8 for 405B."""
    g = LLAMA3_8B
    assert kv_width(g, 1, True) == 4096 and kv_width(g, 8, True) == 512 and kv_width(g, 8) == 128
    c = make_cluster("h100-sxm", 8, 1)
    plain, rep = (cp_comm(g, 1, 8, 2, 400e12, c, impl="torch", kv_repeat=x) for x in (False, True))
    assert rep["bytes_per_step"] == 4 * plain["bytes_per_step"]
    s = Strategy(dp=1, cp=8, zero=3, micro_batch=1)
    q, kv = 32768 * 4096, 2 * 32768 * 4096
    want = 7 * 32 * (42 * q + 4 * kv + 16 * q + 26 * kv) / c.gpu.memory_Bps
    assert merge_s(g, s, 32, 1, c.gpu.memory_Bps, repeat=True) == pytest.approx(want)


def test_torch_balances_the_causal_ring_by_default():
    """The torch ring model (context.py: every rank the same work a step, the diagonal first, K/V all-gathered) is
    what the pinned torch's ``context_parallel`` runs by default: load balancing on, head-tail chunks (rank r
    holds chunks r and 2cp-1-r), the all-gather rotation, and no step skipped on any rank; when 2 x cp does not
    divide the sequence torch shards sequentially (unbalanced), and the planner refuses that cp instead."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as A
    from torch.distributed.tensor.experimental._context_parallel import _load_balancer as L

    assert A._cp_options.enable_load_balance and A._cp_options.rotate_method.name == "ALL_GATHER"
    idx = L._create_default_load_balancer(16, 4, "cpu")._generate_indices()[0].tolist()   # 8 chunks of 2 tokens
    for r in range(4):
        assert idx[4 * r:4 * r + 4] == [2 * r, 2 * r + 1, 2 * (7 - r), 2 * (7 - r) + 1]
    steps = {A._is_causal_behavior(rank=r, world_size=4, i=i, is_causal=True) for r in range(4) for i in range(1, 4)}
    assert steps == {A._CausalBehavior.NOT_IS_CAUSAL}
    assert L._create_default_load_balancer(12, 4, "cpu") is None
    m = gpt_stats(replace(LLAMA3_8B, seq=12), "odd")
    assert "2 x cp = 8 equal chunks" in check_cp_ep(m, Strategy(cp=4))
    assert check_cp_ep(gpt_stats(replace(LLAMA3_8B, seq=16), "even"), Strategy(cp=4)) is None


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
