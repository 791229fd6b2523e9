"""Per-architecture efficiency (tandem/plan/efficiency.py): every preset GPU has a row with its sources, attention
runs at the published kernel utilization over a large GEMM's (FlashAttention-2 on A100: 50-73% of peak, Dao 2023;
FlashAttention-3 on H100: 75%, Shah et al. 2024; a large GEMM ~80%), and --efficiency overrides it."""

import pytest

from tandem.plan import efficiency as E
from tandem.plan.config import Strategy, Training
from tandem.plan.cost import evaluate
from tandem.plan.explain import explain
from tandem.plan.hardware import GPUS, make_cluster
from tandem.plan.model import preset


def test_every_preset_gpu_has_an_architecture_with_sources():
    for name in GPUS:
        a = E.arch_of(name)
        assert a is not None, name
        assert a.linear_source and a.attention_source and 0 < a.attention <= 1.0
    assert E.ARCHS["ampere"].attention == pytest.approx(0.615 / 0.8)
    assert E.ARCHS["hopper"].attention == pytest.approx(0.75 / 0.8)
    assert E.linear("v100-32gb", "gpt") == 0.30 and E.linear("h100-sxm", "gpt") is None
    assert E.attention("custom-gpu") == 1.0


def _plan(gpu, **train):
    m = preset("llama2-7b")
    return evaluate(m, make_cluster(gpu, 8, 1), Training(global_batch=8, **train), Strategy(dp=8, micro_batch=1))


def test_attention_runs_at_its_kernel_share_and_efficiency_overrides_it():
    a100, same = _plan("a100-80gb"), _plan("a100-80gb", efficiency=0.5)
    assert a100.attn_ratio == pytest.approx(0.76875) and same.attn_ratio == 1.0
    # only the attention seconds grow, by 1 / 0.769
    assert a100.attn_s == pytest.approx(same.attn_s / 0.76875)
    assert a100.compute_s - same.compute_s == pytest.approx(a100.attn_s - same.attn_s)
    text = " ".join(explain(a100))
    assert "at 0.769 of that rate (FlashAttention-2 reaches 50-73% of A100 peak" in text
    v100 = _plan("v100-32gb", precision="fp16")
    assert v100.attn_ratio == 1.0 and v100.efficiency == 0.30
