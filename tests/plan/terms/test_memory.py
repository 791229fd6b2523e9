"""Memory formulas against the ZeRO and Megatron papers (sources named by each expected value)."""

import pytest

from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats, params_only
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.memory import gpt_layer_act_bytes, memory


def states(zero, precision="bf16", optimizer="adam", dp=64, params=7.5e9):
    c = make_cluster("a100-80gb", 8, dp // 8)
    t = Training(global_batch=dp, precision=precision, optimizer=optimizer)
    s = Strategy(dp=dp, zero=zero, micro_batch=1)
    m = memory(params_only(params), c, t, s, 1)
    return (m.params + m.grads + m.optimizer) / 1e9


@pytest.mark.parametrize("zero,gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(zero, gb):
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB
    assert states(zero) == pytest.approx(gb, abs=0.06)


def test_mixed_adam_is_16_bytes_per_param():
    assert states(0, dp=8, params=1e9) == pytest.approx(16.0)       # ZeRO paper: 2 + 2 + 12
    assert Training(precision="bf16", optimizer="adamw").optimizer_bytes == 12


@pytest.mark.parametrize("prec,opt,bytes_", [("fp32", "adam", 16), ("fp32", "sgd-momentum", 12),
                                              ("fp32", "sgd", 8), ("bf16", "sgd-momentum", 12), ("fp16", "sgd", 8)])
def test_bytes_per_param(prec, opt, bytes_):
    assert states(0, prec, opt, dp=8, params=1e9) == pytest.approx(bytes_)


def gpt175(t=1):
    return gpt_stats(GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200))


@pytest.mark.parametrize("recompute,tp,expected", [
    # Korthikanti et al. 2022, Table 2 (per layer, 16-bit): sbh(34 + 5as/h); with TP+SP divided by t;
    # selective: 34 sbh / t; full: 2 sbh (with SP / t).
    ("none", 1, lambda s, b, h, a: s * b * h * (34 + 5 * a * s / h)),
    ("none", 8, lambda s, b, h, a: s * b * h * (34 + 5 * a * s / h) / 8),
    ("selective", 8, lambda s, b, h, a: 34 * s * b * h / 8),
    ("full", 8, lambda s, b, h, a: 2 * s * b * h / 8),
])
def test_korthikanti_activation_per_layer(recompute, tp, expected):
    m = gpt175()
    s = Strategy(dp=1, tp=tp, micro_batch=1, recompute=recompute)
    got = gpt_layer_act_bytes(m, s, Training(global_batch=1), 1)
    assert got == pytest.approx(expected(2048, 1, 12288, 96))


def test_1f1b_first_stage_holds_p_micro_batches_gpipe_m():
    m = gpt175()
    c = make_cluster("a100-80gb", 8, 8)
    t = Training(global_batch=64)
    one = memory(m, c, t, Strategy(dp=1, tp=8, pp=8, micro_batch=1, schedule="1f1b"), 64).activations
    gp = memory(m, c, t, Strategy(dp=1, tp=8, pp=8, micro_batch=1, schedule="gpipe"), 64).activations
    # GPipe's last stage holds as many layers' worth as its first, plus the loss's fp32 logits (4sbV/t)
    assert gp == pytest.approx(one * 64 / 8 + 4 * 2048 * 51200 / 8)


def test_zero3_shards_params_over_dp():
    c = make_cluster("a100-80gb", 8, 1)
    t = Training(global_batch=8)
    m0 = memory(params_only(8e9), c, t, Strategy(dp=8, zero=0, micro_batch=1), 1)
    m3 = memory(params_only(8e9), c, t, Strategy(dp=8, zero=3, micro_batch=1), 1)
    assert m3.params == pytest.approx(m0.params / 8)
    assert m3.grads == pytest.approx(m0.grads / 8) and m3.optimizer == pytest.approx(m0.optimizer / 8)


def test_full_recompute_holds_the_recomputed_layers_working_set():
    """Korthikanti et al.'s 2sbh/t per layer, plus the one layer being recomputed during its backward (34sbh/t:
    a fused attention kernel stores no score matrix), plus the fp32 logits on the only stage."""
    m = gpt175()
    c = make_cluster("a100-80gb", 8, 1)
    t = Training(global_batch=1)
    got = memory(m, c, t, Strategy(dp=1, tp=8, micro_batch=1, recompute="full"), 1).activations
    s, b, h, L, V = 2048, 1, 12288, 96, 51200
    assert got == pytest.approx(2 * s * b * h / 8 * L + 34 * s * b * h / 8 + 4 * s * b * V / 8)


def test_activation_arithmetic_is_printed_per_layer():
    # Korthikanti et al. 2022, Table 2: sbh(34 + 5as/h)/t = 2048 x 12288 x (34 + 80) / 8 B = 342 MiB per layer;
    # 1F1B's first stage holds p = 8 micro-batches of its 12 layers = 96 layers' worth: 32.1 GiB
    from tandem.plan.cost import evaluate
    from tandem.plan.explain import explain
    from tandem.plan.inputs.model import preset
    p = evaluate(preset("gpt3-175b"), make_cluster("a100-80gb", 8, 8), Training(global_batch=64),
                 Strategy(dp=1, tp=8, pp=8, micro_batch=1))
    line = next(x for x in explain(p) if x.startswith("Activations:"))
    assert "(34 + 5as/h, 5as/h = 80)" in line and "342 MiB per layer x 96 layers in flight" in line
    assert line.endswith("= 32.1 GiB.")


def test_deferred_sync_activations_line_describes_the_memory_lines_rank():
    """Under pp_grad_sync step the memory line takes the activations of the rank where activations + gradients
    peak (memory.deferred_peak): here the last rank, though the first holds the most activations alone
    (activation_parts). The Activations line describes that rank and sums to the memory line's number."""
    import re

    from tandem.plan.cost import evaluate
    from tandem.plan.explain import explain
    from tandem.plan.units import gib
    from tandem.plan.terms.memory import activation_parts

    m = gpt_stats(GPTShape(layers=24, hidden=4096, heads=16, seq=4096, vocab=256000))
    t = Training(global_batch=64, precision="bf16", attention_kernel="fa2", pp_grad_sync="step")
    s = Strategy(dp=16, pp=4, zero=3, micro_batch=1, ranks_per_node=8, schedule="interleaved", virtual=2)
    p = evaluate(m, make_cluster("h100-sxm", 8, 8), t, s)
    assert activation_parts(m, s, t, p.grad_accum)["stage"] == "first" and p.memory.peak_rank == 3
    lines = explain(p)
    act = next(x for x in lines if x.startswith("Activations"))
    mem = next(x for x in lines if x.startswith("Memory per GPU"))
    assert "on pipeline rank 3, at its peak of activations + gradients" in act
    assert act.endswith(f"= {gib(p.memory.activations)}.") and f"activations {gib(p.memory.activations)}" in mem
    per, layers = re.search(r"= ([\d.]+) MiB per layer x ([\d.]+) layers in flight", act).groups()
    logits = 4 * 4096 * 256000 / 2**20
    assert (float(per) * float(layers) + logits) * 2**20 == pytest.approx(p.memory.activations, rel=0.002)


@pytest.mark.slow   # imports torch.distributed.tensor (~6 s on 2 loaded cores); the planner's own tests need no torch
def test_loss_bytes_per_logit_are_what_torch_allocates(tmp_path):
    """memory.loss_bytes' 12 B (F.cross_entropy(logits.float())) and 16 B (torch's loss_parallel under tp), measured:
    every storage an op makes is counted while alive (a dispatch mode; freed by refcount), inside loss_parallel's own
    handlers too, over the backward of a (tokens x vocabulary) bf16 logit matrix whose forward kept its FP32
    log-softmax (torchtitan's `del pred` before backward). One gloo rank: the vocabulary shard is the whole
    vocabulary, the DTensor handlers the same as at any tp."""
    import contextlib
    import weakref

    import torch
    import torch.distributed as dist
    import torch.distributed.tensor.parallel.loss as lp
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from tandem.plan.terms.memory import LOSS_PARALLEL_BYTES, UNFUSED_LOSS_BYTES

    live = {"now": 0, "peak": 0, "seen": set()}

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor):
                    x = getattr(x, "_local_tensor", x)
                    try:
                        st = x.untyped_storage()
                        key = st.data_ptr()
                    except RuntimeError:   # a functional collective's async wrapper: no storage of its own
                        continue
                    if key in live["seen"] or not st.nbytes():
                        continue
                    live["seen"].add(key)
                    live["now"] += st.nbytes()
                    live["peak"] = max(live["peak"], live["now"])
                    weakref.finalize(st, lambda k=key, n=st.nbytes(): (live.__setitem__("now", live["now"] - n),
                                                                        live["seen"].discard(k)))
            return out

    def inside(f):   # loss_parallel's handlers call plain ops on the local shards: count those too
        def run(*a, **k):
            with Live():
                return f(*a, **k)
        return run

    tokens, vocab = 1024, 2048
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        target = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
        peaks = {}
        patched = {n: getattr(lp, n) for n in ("_log_softmax", "_nll_loss_and_log_softmax_backward")}
        for n, f in patched.items():
            setattr(lp, n, inside(f))
        for name in ("native", "loss_parallel"):
            x = torch.randn(tokens, vocab, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
            if name == "loss_parallel":
                x = DTensor.from_local(x, mesh, [Shard(1)])
            x.requires_grad_()
            with Live(), (lp.loss_parallel() if name == "loss_parallel" else contextlib.nullcontext()):
                pred = x * 1   # the output layer's bf16 logits
                loss = F.cross_entropy(pred.float(), target)
                del pred
                live["peak"] = base = live["now"]
                loss.backward()
            peaks[name] = (live["peak"] - base) / (tokens * vocab) + base / (tokens * vocab)
            del x, loss
        for n, f in patched.items():
            setattr(lp, n, f)
    finally:
        dist.destroy_process_group()
    assert peaks["native"] == pytest.approx(UNFUSED_LOSS_BYTES, abs=0.05), peaks
    assert peaks["loss_parallel"] == pytest.approx(LOSS_PARALLEL_BYTES, abs=0.05), peaks


def test_torch_pipelining_buffers_follow_its_stage_code():
    """memory.pipeline_buffers under torchtitan's torch (pp_outputs "all"), 2 stages, 4 micro-batches, tp 2: per
    micro-batch a b x s/tp x h receive buffer (activations on stage 1, gradients on stage 0), every output kept
    (stage 0's b x s/tp x h, stage 1's b x s x V/tp logits), stage 1's input gradients kept; stage 1's first block's
    saved input is its receive buffer (taken off the flight). Under 1F1B rank 0 peaks at its last forward: 2
    micro-batches in flight, 4 outputs kept. tandem's
    runtime (not torch's pipelining under deferred sync): nothing."""
    from tandem.plan.terms.grad_sync import peak
    from tandem.plan.terms.memory import pipeline_buffers

    m = gpt_stats(GPTShape(layers=4, hidden=1024, heads=8, seq=2048, vocab=32000))
    s = Strategy(dp=2, tp=2, pp=2, zero=3, micro_batch=2)
    t = Training(global_batch=16, precision="bf16", runtime="torchtitan", pp_grad_sync="step")
    bound, logits = 2 * 2048 * 1024 / 2 * 2, 2 * 2048 * 32000 / 2 * 2
    assert pipeline_buffers(m, t, s, 4, 0) == (4 * bound, (0.0,), (bound,), (0.0,))
    assert pipeline_buffers(m, t, s, 4, 1) == (4 * bound, (-bound,), (logits,), (bound,))
    const, fly, keep_f, keep_b = pipeline_buffers(m, t, s, 4, 0)
    act, _, pipe, _ = peak((2,), 2, 4, 0, 10 * bound, 0.0, 0.0, 0, fly, keep_f, keep_b)
    assert (act, pipe) == (2 * 2 * 10 * bound + 4 * bound, 4 * bound)   # its last forward: 2 in flight, 4 kept
    tandem = Training(global_batch=16, precision="bf16", pp_grad_sync="step")
    assert pipeline_buffers(m, tandem, s, 4, 1) == (0.0, (), (), ())
