"""Context and expert parallelism inside the planner: degrees, memory, communication, search, CLI."""

import json

import pytest

from tandem.core.errors import ConfigError
from tandem.plan.cost import check, evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import DEEPSEEK_V3, expert_params, mlp_params, moe_params, preset
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.report import to_dict
from tandem.plan.search import candidates, search
from tandem.plan.terms.memory import states_per_gpu
from tandem.plan.terms.params import stage_states

H100x8 = dict(gpu="h100-sxm", gpus_per_node=8, inter="ib-ndr", nics_per_node=8)


def ops(p):
    return {o.name: o for o in p.comm}


def test_world_counts_cp_and_errors_show_the_arithmetic():
    c = make_cluster(**H100x8)
    m, t = preset("llama2-7b", seq=32768), Training(global_batch=8)
    assert check(m, c, t, Strategy(dp=2, tp=2, cp=2)) is None
    why = check(m, c, t, Strategy(dp=4, tp=2, cp=2))
    assert why == "dp x tp x pp x cp = 4x2x1x2 = 16, but the cluster has 8 GPUs"
    odd = preset("llama2-7b", seq=4100)
    assert "2 x cp = 8 equal chunks (4100 % 8 = 4)" in check(odd, c, Training(global_batch=2), Strategy(dp=2, cp=4))
    assert "needs an MoE model" in check(m, c, t, Strategy(dp=8, ep=2))
    mix = preset("mixtral-8x7b")
    c16 = make_cluster(**{**H100x8, "nodes": 2})
    assert check(mix, c16, Training(global_batch=16), Strategy(dp=16, ep=16)) == \
        "ep 16 does not divide the 8 experts (8 % 16 = 8)"


def test_context_parallel_splits_activations_and_passes_kv_around_the_ring():
    c = make_cluster(**H100x8)
    m, t = preset("llama2-7b", seq=32768), Training(global_batch=8)
    one = evaluate(m, c, t, Strategy(dp=8, micro_batch=1, recompute="selective"))
    two = evaluate(m, c, t, Strategy(dp=4, cp=2, micro_batch=1, recompute="selective"))
    # each GPU holds s/cp tokens: layers and logits both halve (Korthikanti et al.'s formula at s/2)
    assert two.memory.activations == pytest.approx(one.memory.activations / 2)
    ring = ops(two)["cp-ring"]
    g = m.gpt
    assert ring.bytes == 2 * 1 * (32768 // 2) * g.kv_dim * 2           # K and V of one chunk, bf16
    assert ring.calls == (2 - 1) * g.layers * 2 * two.grad_accum       # fwd + bwd steps, every micro-batch
    assert ring.exposed_s == 0.0 < ring.time_s    # 16k tokens a GPU: NVLink hides behind the block's attention
    # the cp ranks hold the same weights: gradients reduce over dp x cp = 8 GPUs as before
    assert ops(two)["dp-grad"].group.size == 8 == ops(one)["dp-grad"].group.size
    # the same FLOPs per GPU (the world is still 8 GPUs)
    assert two.hw_flops_per_gpu == pytest.approx(one.hw_flops_per_gpu)
    text = "\n".join(to_dict(two)["explain"])
    assert "ring attention over cp 2" in text and "32768/2 = 16384" in text and "x cp 2" in text


def test_expert_parallel_memory_and_routing():
    c = make_cluster(**H100x8)
    m, t = preset("mixtral-8x7b"), Training(global_batch=64, optimizer="adam")
    p = evaluate(m, c, t, Strategy(dp=8, ep=8, zero=1, micro_batch=1, recompute="full"))
    st = states_per_gpu(m.moe, tp=1, pp=1, ep=8, dp=8, zero=1, by=t.bytes, optimizer_bytes=t.optimizer_bytes)
    mem = p.memory
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(st["params"] + st["grads"] + st["optimizer"])
    a2a = ops(p)["ep-all-to-all"]
    assert a2a.bytes == 1 * 4096 * 2 * 1.0 * 4096 * 2        # b x s x top_k x capacity x h x 2 B
    assert a2a.calls == 6 * 32 * p.grad_accum                # full recompute: the forward's 2 run again
    assert a2a.exposed_s == a2a.time_s and a2a.link == "nvlink4"
    assert "ep-grad" not in ops(p)                           # dp / ep = 1: each GPU owns its experts
    # the optimizer step updates the experts too: non-expert / dp 8 + this GPU's experts / (dp / ep = 1)
    ne, e = stage_states(m.moe, (32,), 1, 8)
    assert e > 20 * ne / 8
    from tandem.plan.terms import bandwidth_bound as MB
    assert p.optimizer_s == pytest.approx(MB.optimizer_seconds(ne / 8 + e, c, t))
    assert "parameters this GPU updates (experts included)" in "\n".join(to_dict(p)["explain"])
    # two nodes, dp 16: the experts' gradients reduce over the 2 GPUs holding the same experts (8 apart,
    # so across nodes), the rest over all 16
    c2 = make_cluster(**{**H100x8, "nodes": 2})
    p2 = evaluate(m, c2, Training(global_batch=64, optimizer="adam"), Strategy(dp=16, ep=8, zero=1, micro_batch=1))
    eg = ops(p2)["ep-grad"]
    assert (eg.group.size, eg.group.nodes, ops(p2)["dp-grad"].group.size) == (2, 2, 16)
    assert eg.bytes == pytest.approx(expert_params(m.moe) / 8 * 4)   # BF16 grads reduced in FP32 (Megatron)
    text = "\n".join(to_dict(p2)["explain"])
    assert "top_k 2 of 8 experts" in text and "dp x cp / ep = 16 x 1 / 8 = 2 GPUs" in text


def test_search_tries_expert_and_context_degrees_only_where_the_model_needs_them():
    c = make_cluster(**{**H100x8, "nodes": 2})
    r = search(preset("mixtral-8x7b"), c, Training(global_batch=64, optimizer="adam"), zeros=(1,),
               recomputes=("full",), schedules=("1f1b",))
    eps = {p.strategy.ep for p in r.ranked}
    assert {1, 2, 4, 8} <= eps and r.ranked[0].memory.fits
    assert {p.strategy.cp for p in r.ranked} == {1}            # 4k tokens: no cp tried
    dense = search(preset("llama2-7b", seq=32768), make_cluster(**H100x8), Training(global_batch=8),
                   zeros=(1,), recomputes=("selective",), schedules=("1f1b",))
    assert {p.strategy.ep for p in dense.ranked} == {1}
    assert {1, 2, 4} <= {p.strategy.cp for p in dense.ranked}
    long = candidates(preset("llama2-7b", seq=32768), make_cluster(**H100x8), Training(global_batch=8))
    assert {s.cp for s in long} == {1, 2, 4, 8}


def test_cli_cp_ep(tmp_path):
    from typer.testing import CliRunner

    from tandem.cli import app

    args = ["plan", "mixtral-8x7b", "--gpu", "h100-sxm", "--nodes", "2", "--inter", "ib-ndr", "--nics-per-node",
            "8", "--tp", "2", "--cp", "2", "--ep", "4", "--zero", "1", "--micro-batch", "1", "--global-batch", "64",
            "--recompute", "full", "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert (d["strategy"]["dp"], d["strategy"]["cp"], d["strategy"]["ep"]) == (4, 2, 4)
    assert d["model"]["moe"]["experts"] == 8 and {"cp-ring", "ep-all-to-all"} <= {o["name"] for o in d["comm"]}
    # the resolved kernel and reduction dtype, and compute_s's parts
    st, tm = d["strategy"], d["time"]
    assert (st["attention_kernel"], st["grad_reduce"], st["kernels"], st["flash_attention"]) == \
        ("cudnn", "fp32", "fused", True)
    assert 0 < tm["attn_s"] < tm["compute_s"] and tm["mem_bound_s"] > 0 and tm["optimizer_s"] > 0
    assert tm["cp_merge_s"] == 0    # Megatron's ring merges inside the kernel; torch's would be > 0
    # dp 1 x cp 2: the cp ranks still reduce gradients, in FP32 (BF16 at ZeRO-1)
    one = CliRunner().invoke(app, ["plan", "llama2-7b", "--gpu", "h100-sxm", "--tp", "4", "--cp", "2", "--zero", "1",
                                   "--global-batch", "8", "--json"])
    d1 = json.loads(one.output)
    assert d1["strategy"]["dp"] == 1 and d1["strategy"]["grad_reduce"] == "fp32"
    bad = CliRunner().invoke(app, ["plan", "llama2-7b", "--cp", "3"])
    assert isinstance(bad.exception, ConfigError) and bad.exception.field == "cp"
    assert "tp 1 x pp 1 x cp 3 = 3 does not divide the 8 GPUs (8 % 3 = 2)" in str(bad.exception)


def test_flash_attention_drops_the_score_matrix_without_recompute():
    c = make_cluster(**H100x8)
    m = preset("llama2-7b", seq=32768)
    s = Strategy(dp=4, cp=2, micro_batch=1)
    eager = evaluate(m, c, Training(global_batch=8), s)
    fused = evaluate(m, c, Training(global_batch=8, flash_attention=True), s)
    sel = evaluate(m, c, Training(global_batch=8), Strategy(dp=4, cp=2, micro_batch=1, recompute="selective"))
    assert fused.memory.activations == pytest.approx(sel.memory.activations)
    # ring attention (cp > 1) runs fused kernels: sized as it is timed, no s x s scores, whatever the flag
    assert eager.memory.activations == pytest.approx(fused.memory.activations)
    assert to_dict(eager)["strategy"]["flash_attention"] is True
    one = Strategy(dp=8, micro_batch=1)     # without cp the flag decides
    plain, flash = (evaluate(m, c, Training(global_batch=8, flash_attention=f), one) for f in (False, True))
    assert flash.memory.activations < plain.memory.activations / 3
    # no recompute FLOPs; under cp ring attention runs fused kernels whatever the flag (efficiency.kernel; the CLI
    # turns --flash-attention on for cp > 1 unless told otherwise)
    assert fused.attn_kernel == eager.attn_kernel == "cudnn" and fused.attn_s == pytest.approx(eager.attn_s)
    assert fused.compute_s - fused.attn_s == pytest.approx(eager.compute_s - eager.attn_s)
    assert eager.compute_s < sel.compute_s
    line = next(x for x in to_dict(fused)["explain"] if x.startswith("Activations:"))
    assert "5as/h" not in line and "fused attention: no score matrix stored" in line


def test_moe_stage_states_add_up_and_put_the_dense_layers_first():
    d = DEEPSEEK_V3
    dense, expert = stage_states(d, (61,), 1, 1)
    assert dense + expert == pytest.approx(moe_params(d)) and expert == expert_params(d)
    # 61 layers on 2 stages (31, 30): the first holds the embedding and the 3 dense layers, so fewer experts
    first = stage_states(d, (31, 0), 1, 8)
    assert first[1] == pytest.approx((31 - 3) * d.experts * mlp_params(d.base, d.expert_ffn) / 8)


def test_expert_ffn_needs_to_divide_tp_only_where_the_runtime_splits_experts():
    from dataclasses import replace

    from tandem.plan.inputs.model import MIXTRAL_8X7B, moe_stats

    odd = moe_stats(replace(MIXTRAL_8X7B, expert_ffn=14335), "odd-ffn")   # 14335 = 5 x 47 x 61: no tp 2 split
    c, s = make_cluster(**H100x8), Strategy(dp=4, tp=2, ep=2)
    # tandem's trainer keeps each expert whole on its tp ranks (expert.py): any expert_ffn trains
    assert check(odd, c, Training(global_batch=8), s) is None
    for rt in ("torchtitan", "megatron"):   # expert-tensor parallel = tp: w1/w3 split column-wise
        why = check(odd, c, Training(global_batch=8, runtime=rt), s)
        assert why == "expert ffn 14335 is not divisible by tp 2 (the runtime splits each expert over the tp ranks)"
    assert check(moe_stats(MIXTRAL_8X7B), c, Training(global_batch=8, runtime="megatron"), s) is None
