"""Memory-bound work outside the GEMMs (tandem/plan/terms/bandwidth_bound.py): the per-layer elementwise and norm passes, the
loss over the vocabulary and the optimizer step, as bytes at 0.9 of the memory bandwidth, by what the framework
fuses; and where it is not charged (CPU hosts, a measured compute time, --efficiency)."""

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.explain import explain
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats, preset
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms import bandwidth_bound as MB, efficiency as E


def test_llama_layer_bytes_counted_op_by_op():
    g = preset("llama2-7b").gpt   # h 4096, ffn 11008, kv 4096, V 32000, RMSNorm, SwiGLU, rotary
    h, f, qk, V = 4096, 11008, 8192, 32000
    # fused: 2 norms 4h fwd 6h bwd, 2 residual adds 6h / 6h, SwiGLU 3f / 5f, rotary 2(h+kv) / 2(h+kv), at 2 B
    layer, loss = MB.layer_bytes(g, "fused", 2)
    assert layer == 2 * (10 * h + 3 * f + 2 * qk + 12 * h + 5 * f + 2 * qk) == 421_888
    assert loss == 2 * 3 * V == 192_000    # fused cross-entropy: read the logits forward, read + write backward
    # compiled: residual add folded into the next norm (8h / 8h), the rest as fused
    assert MB.layer_bytes(g, "compiled", 2)[0] == 2 * (8 * h + 3 * f + 2 * qk + 8 * h + 5 * f + 2 * qk)
    # eager: RMSNorm composed (14h / 36h), adds, silu + mul (5f / 9f), rotary through fp32 complex (10 / 10)
    eager, eager_loss = MB.layer_bytes(g, "eager", 2)
    assert eager == 2 * (20 * h + 5 * f + 10 * qk + 42 * h + 9 * f + 10 * qk)
    assert eager_loss == 2 * 18 * V and MB.layer_bytes(g, "eager", 2, fused_loss=True)[1] == loss
    # full recompute runs each layer's forward twice
    assert MB.layer_bytes(g, "fused", 2, "full")[0] == layer + 2 * (10 * h + 3 * f + 2 * qk)
    # FP8 under Transformer Engine: the norms and SwiGLU write FP8 from the same kernel as the cast
    assert MB.layer_bytes(g, "fused", 2, fp8=True)[0] == layer - 2 * (4 * h + 2 * f)


def test_plan_charges_them_at_the_memory_bandwidth():
    m = preset("llama2-7b")
    c = make_cluster("h100-sxm", 8, 1)
    t = Training(global_batch=8, flash_attention=True)
    p = evaluate(m, c, t, Strategy(dp=8, zero=3, micro_batch=1))
    bw = 0.9 * 3350e9
    assert p.mem_bound_s == pytest.approx(8 * 4096 * (32 * 421_888 + 192_000) / 8 / bw)
    # fused AdamW 28 B + 16-bit copy 6 B + clipping 12 B per parameter, ZeRO-3 shards them over 8
    assert MB.optimizer_bytes_per_param(t) == 46
    assert p.optimizer_s == pytest.approx(m.params / 8 * 46 / bw)
    eager = evaluate(m, c, Training(global_batch=8, flash_attention=True, kernels="eager"),
                     Strategy(dp=8, zero=3, micro_batch=1))
    assert eager.optimizer_s == pytest.approx(m.params / 8 * (80 + 6 + 12) / bw)   # foreach: eight passes
    assert eager.mem_bound_s > 1.5 * p.mem_bound_s and eager.step_s > p.step_s
    # tensor parallelism (with sequence parallelism) splits them as it splits the layer
    tp = evaluate(m, c, t, Strategy(dp=4, tp=2, micro_batch=1))
    assert tp.mem_bound_s == pytest.approx(p.mem_bound_s)
    text = " ".join(explain(p))
    assert "Memory-bound ops (fused kernels" in text and "421.9 kB a layer x 32 layers + 192 kB the loss" in text
    assert "= 46 B per parameter x 842.3 M parameters this GPU updates (ZeRO-sharded)" in text
    assert f"+ memory-bound ops {p.mem_bound_s * 1e3:.3g} ms" in text


def test_small_models_pay_a_larger_share():
    c = make_cluster("a100-80gb", 8, 1)
    shares = []
    for h, L in ((768, 12), (2048, 24), (12288, 96)):
        m = gpt_stats(GPTShape(layers=L, hidden=h, heads=h // 64, seq=2048, vocab=50368))
        p = evaluate(m, c, Training(global_batch=64, flash_attention=True), Strategy(dp=8, zero=3, micro_batch=8))
        shares.append(p.mem_bound_s / p.compute_s)
    assert shares == sorted(shares, reverse=True) and shares[0] > 0.08 and shares[-1] < 0.02


def test_not_charged_where_the_rate_already_holds_them():
    m = preset("llama2-7b")
    c = make_cluster("h100-sxm", 8, 1)
    s = Strategy(dp=8, micro_batch=1)
    for t in (Training(global_batch=8, efficiency=0.4), Training(global_batch=8, compute_time_s=1.0)):
        p = evaluate(m, c, t, s)
        assert p.mem_bound_s == p.optimizer_s == 0
        left = next(x for x in explain(p) if x.startswith("Left out:"))
        assert "optimizer-step time" in left
    # timed: its own line, so "Left out" does not name it (nor fused kernels, which --kernels covers)
    text = explain(evaluate(m, c, Training(global_batch=8), s))
    left = next(x for x in text if x.startswith("Left out:"))
    assert any(x.startswith("Optimizer step:") for x in text)
    assert "optimizer-step" not in left and "kernel launch time" in left and "beyond what --kernels says" in left
    # no memory bandwidth known (a CPU host or a custom GPU): nothing to time them with
    cpu = type("C", (), {"gpu": type("G", (), {"memory_Bps": 0.0})()})()
    assert MB.step_seconds(m, cpu, Training(), s) == 0 and MB.optimizer_seconds(1e9, cpu, Training()) == 0


def test_h100_share_is_the_end_to_end_figure_without_them():
    # Megatron-LM's strong-scaling model, GPT-3 175B at sequence 4096, vocabulary 131072, on 96 H100s, BF16
    m = gpt_stats(GPTShape(layers=96, hidden=12288, heads=96, seq=4096, vocab=131072))
    c = make_cluster("h100-sxm", 8, 12, inter="ib-ndr", nics_per_node=8)
    t = Training(global_batch=192, flash_attention=True, overlap_param_gather=True)
    p = evaluate(m, c, t, Strategy(dp=3, tp=4, pp=8, zero=1, micro_batch=1))
    mem = p.mem_bound_s / (p.compute_s - p.optimizer_s)
    # 1.45% when the share was derived (attention then a factor of the linear rate); 1.50% with cuDNN's causal
    # attention by length (faster attention, a larger memory-bound share): 0.50 / (1 - 0.0163) = 0.5083, the same
    # 0.508 to the precision the sources carry
    assert mem == pytest.approx(0.0150, abs=0.0005) and p.optimizer_s / p.step_s == pytest.approx(0.0013, abs=3e-4)
    assert E.ARCHS["hopper"].linear == pytest.approx(0.50 / (1 - mem - p.optimizer_s / p.step_s), abs=0.0005)


def test_a_tandem_job_spec_is_planned_as_tandems_trainer_runs(tmp_path):
    """tandem's trainer is eager PyTorch (torch.compile with parallel.compile), foreach AdamW, autocast over fp32
    weights (no 16-bit copy), clipping only with optim.clip_grad_norm > 0."""
    from pathlib import Path

    from tandem.plan.inputs.args import from_job_spec

    src = Path(__file__).resolve().parents[3] / "examples" / "gpt_stdlib.toml"
    spec = from_job_spec(str(src))
    assert spec["kernels"] == "eager" and spec["_clip_grad"] is False and spec["_autocast"] is False
    t = Training(precision="fp32", kernels=spec["kernels"], clip_grad=False)
    assert MB.optimizer_parts(t) == {"AdamW foreach": 80} and MB.optimizer_bytes_per_param(t) == 80
    text = src.read_text().replace('[optim]\n', '[optim]\nclip_grad_norm = 1.0\n')
    text = text.replace('[launch]\n', '[parallel]\ncompile = true\n[precision]\ndtype = "bf16"\n[launch]\n')
    (tmp_path / "j.toml").write_text(text)
    spec = from_job_spec(str(tmp_path / "j.toml"))
    assert spec["kernels"] == "compiled" and spec["_clip_grad"] is True and spec["_autocast"] is True
    assert spec["fused_loss"] is False and spec["grad_reduce"] == "fp32"   # fp32 gradients under autocast
    from tandem.plan.inputs.args import PlanArgs, resolve

    _, _, t, _ = resolve(PlanArgs(config=str(tmp_path / "j.toml")))
    assert (t.autocast, t.clip_grad, t.fused_loss, t.grad_reduce, t.kernels) == (True, True, False, "fp32", "compiled")
    _, _, t, _ = resolve(PlanArgs(config=str(src), precision="bf16"))   # fp32 spec, --precision bf16: autocast
    assert t.autocast and not t.clip_grad
    t = Training(precision="bf16", kernels="compiled", autocast=True)
    assert MB.optimizer_bytes_per_param(t) == 80 + 12
    # a Megatron-style plan (flags): 16-bit weights with an fp32 master, fused, clipped
    assert MB.optimizer_bytes_per_param(Training()) == 28 + 6 + 12
    assert MB.optimizer_bytes_per_param(Training(precision="fp32")) == 28 + 12


@pytest.mark.parametrize("kernels,opt,update", [("fused", "sgd", 12), ("fused", "sgd-momentum", 20),
                                                ("eager", "sgd", 12), ("compiled", "sgd-momentum", 32)])
def test_sgd_step_is_timed_as_torch_moves_it(kernels, opt, update):
    """torch 2.13's SGD: fused (FusedSgdKernel.cu: reads weight, gradient (and buffer), writes weight (and buffer))
    12 / 20 B; foreach (_multi_tensor_sgd: the update 12 B, momentum's mul_ 8 + add_ 12 before it) 12 / 32 B; plus
    the 16-bit copy (6 B) and gradient clipping (12 B) as for AdamW."""
    c = make_cluster("h100-sxm", 8, 1)
    t = Training(optimizer=opt, kernels=kernels)
    impl = "fused" if kernels == "fused" else "foreach"
    assert MB.optimizer_parts(t) == {f"SGD{' momentum' if opt == 'sgd-momentum' else ''} {impl}": update,
                                     "16-bit copy": 6, "gradient clipping": 12}
    bw = c.gpu.memory_Bps * MB.BANDWIDTH_SHARE
    assert MB.optimizer_seconds(1e9, c, t) == pytest.approx(1e9 * (update + 18) / bw)
    # torch's foreach spends a pass each on SGD's coupled weight decay and on Nesterov; fused does them in-kernel
    extra = Training(optimizer=opt, kernels=kernels, weight_decay=True, nesterov=True)
    passes = 0 if impl == "fused" else 12 * (1 + (opt == "sgd-momentum"))
    assert MB.optimizer_bytes_per_param(extra) == update + 18 + passes


def test_a_tandem_sgd_job_spec_times_its_step(tmp_path):
    """tandem's SGD defaults (momentum 0.9, weight decay 5e-4, eager foreach, autocast over fp32 weights): 32 B +
    12 B of weight decay a parameter; the explain line's arithmetic gives the step's optimizer seconds."""
    import re
    from pathlib import Path

    from tandem.plan.inputs.args import PlanArgs, resolve, strategy

    src = Path(__file__).resolve().parents[3] / "examples" / "gpt_stdlib.toml"
    text = src.read_text().replace('name = "adamw"', 'name = "sgd"').replace("weight_decay = 0.0\n", "")
    text = text.replace("[launch]\n", '[precision]\ndtype = "bf16"\n[launch]\n')
    (tmp_path / "j.toml").write_text(text)
    m, c, t, v = resolve(PlanArgs(config=str(tmp_path / "j.toml"), gpu="a100-80gb"))
    assert (t.optimizer, t.weight_decay, t.nesterov, t.autocast, t.clip_grad) == ("sgd-momentum", True, False,
                                                                                   True, False)
    p = evaluate(m, c, t, strategy(v, c, t))
    line = next(x for x in explain(p) if x.startswith("Optimizer step:"))
    assert "SGD momentum foreach 32 B + weight decay (foreach) 12 B = 44 B per parameter" in line
    n, total = re.search(r"x ([\d.]+) k parameters this GPU updates.* = ([\d.]+) ms", line).groups()
    bw = c.gpu.memory_Bps * MB.BANDWIDTH_SHARE
    assert p.optimizer_s > 0 and float(total) * 1e-3 == pytest.approx(44 * float(n) * 1e3 / bw, rel=5e-3)  # 3 digits
    assert p.optimizer_s == pytest.approx(float(total) * 1e-3, rel=5e-3)
