"""Meta-device build: the same initial weights as one process, and no rank ever holds the whole model.

The strategies' numerics against one process (test_numerics.py) run on the materialized build;
here: the per-tensor initialisation itself, the fallback for a user's factory, and per-rank peak
memory on real processes (zero3 builds a model a rank could not hold whole; its step peaks below
ddp's). bench/meta_memory.py measures the same at 113M parameters on 4 ranks against the planner.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tandem.core.spec import ModelSpec
from tandem.models import build_model
from tandem.models.init import default_init, full_value
from tandem.train.parallel.materialize import build_meta, is_meta, materialize

GPT = ModelSpec(name="gpt", layers=3, hidden=32, heads=4, kv_heads=2, seq=8, vocab=16)
RESNET = ModelSpec(name="resnet18", width=4, in_channels=1, small_input=True)
LLAMA = ModelSpec(name="llama", layers=3, hidden=32, heads=4, kv_heads=2, ffn=48, seq=8, vocab=16, qkv_bias=True,
                  qk_norm=True, rope_scaling={"rope_type": "llama3", "factor": 8.0})


@pytest.mark.parametrize("ms", [GPT, RESNET, LLAMA], ids=["gpt", "resnet", "llama"])
def test_meta_build_equals_a_seeded_cpu_build(ms):
    torch.manual_seed(7)
    cpu = build_model(ms)
    meta = build_meta(ms, torch.device("cpu"))
    assert is_meta(meta)
    materialize(meta, torch.device("cpu"), 7)
    assert not is_meta(meta)
    a, b = cpu.state_dict(), meta.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    bufs = dict(meta.named_buffers())   # non-persistent ones too (llama's rotary table)
    assert all(torch.equal(t, bufs[k]) for k, t in cpu.named_buffers())
    torch.manual_seed(8)
    other = build_model(ms).state_dict()  # another seed, other weights (the init is not constant)
    key = "conv1.weight" if ms.name == "resnet18" else "layers.0.attn.wq.weight"
    assert not torch.equal(other[key], a[key])


def test_tied_head_stays_tied_and_a_pruned_stage_gets_the_full_models_values():
    from tandem.train.parallel import pp
    meta = build_meta(GPT, torch.device("cpu"))
    materialize(meta, torch.device("cpu"), 3)
    assert meta.head.weight is meta.tok_emb.weight
    ref = meta.state_dict()
    untied = copy.deepcopy(GPT)
    untied.tied = False
    stage = build_meta(untied, torch.device("cpu"))
    pp.keep_only(stage, [[0], [1, 2]], [1])   # the last stage of two: blocks 1-2, norm and head
    materialize(stage, torch.device("cpu"), 3)
    got = stage.state_dict()
    assert "layers.0.ln1.weight" not in got and "tok_emb.weight" not in got
    assert all(torch.equal(got[k], ref[k]) for k in got if k != "head.weight")
    assert torch.equal(got["head.weight"], full_value(stage, stage.head, "head.weight", (16, 32), torch.float32, 3))


def test_gpt_init_statistics_are_gpt2s():
    torch.manual_seed(0)
    m = build_model(ModelSpec(name="gpt", layers=8, hidden=256, heads=4, seq=8, vocab=64))
    assert abs(m.layers["0"].attn.wq.weight.std().item() - 0.02) < 1e-3
    assert abs(m.layers["0"].attn.wo.weight.std().item() - 0.02 / 4) < 3e-4  # 1/sqrt(2 x 8 layers)
    assert torch.equal(m.layers["0"].ln1.weight, torch.ones(256)) and not m.layers["0"].attn.wq.bias.any()


def test_user_factory_is_built_for_real_and_left_alone(monkeypatch, tmp_path):
    (tmp_path / "mymods.py").write_text("import torch\ndef net(num_classes=10, in_channels=1):\n"
                                        "    return torch.nn.Linear(in_channels * 64, num_classes)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.manual_seed(1)
    m = build_meta(ModelSpec(name="mymods:net"), torch.device("cpu"))
    assert not is_meta(m)
    w = m.weight.detach().clone()
    materialize(m, torch.device("cpu"), 1)
    assert torch.equal(m.weight, w)


def test_a_layer_without_a_rule_is_a_clear_error():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(3))
    with pytest.raises(TypeError, match="no initialisation rule for scale of Odd"):
        default_init(Odd(), "scale", torch.empty(3), torch.Generator())


def _mem_job(strategy: str):
    from tandem.core.spec import JobSpec
    s = JobSpec()
    m = s.model
    m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.seq, m.vocab, m.tied = "gpt", 6, 768, 12, 0, 8, 16, True
    s.data.name = "reverse"
    s.parallel.strategy = strategy
    s.optim.name, s.optim.ref_batch, s.optim.lr, s.optim.weight_decay = "adamw", 0, 1e-3, 0.0
    s.schedule.global_batch, s.schedule.micro_batch = 2, 1
    s.launch.nproc_per_node = 2
    return s


@pytest.mark.slow
def test_zero3_builds_a_model_no_rank_holds_and_peaks_below_ddp(monkeypatch):
    """A 42.5M-parameter GPT (170 MB in fp32) on 2 ranks. The 'budget': 3/4 of the model. Under
    zero3 each rank's build peaks within it (half the model plus one tensor; the old build, whole
    model then shard, needed all of it); a step's peak (params, grads, AdamW state) stays below ddp's."""
    from harness.numerics import spawn
    from harness.memcheck import build_and_step
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # RSS follows the tensors (bench/meta_memory.py)
    z3 = spawn(build_and_step, 2, _mem_job("zero3"), steps=1)
    ddp = spawn(build_and_step, 2, _mem_job("ddp"), steps=1)
    full = z3[0]["model_bytes"]
    assert full > 160e6
    budget = 0.75 * full
    for r in z3:
        assert r["kind"] == "rss_hwm"
        assert r["local_param_bytes"] <= full / 2 + 4096
        assert r["built"] < budget, (r["built"], budget)
    for r in ddp:
        assert r["built"] >= 0.95 * full  # a replica holds it all: the measurement sees a model's bytes
    z3_step, ddp_step = max(r["step"] for r in z3), min(r["step"] for r in ddp)
    print(f"model {full / 2**20:.0f} MiB; built: zero3 {max(r['built'] for r in z3) / 2**20:.0f} MiB, "
          f"ddp {min(r['built'] for r in ddp) / 2**20:.0f} MiB; step peak: zero3 {z3_step / 2**20:.0f} MiB, "
          f"ddp {ddp_step / 2**20:.0f} MiB")
    assert z3_step < 0.6 * ddp_step, (z3_step, ddp_step)
