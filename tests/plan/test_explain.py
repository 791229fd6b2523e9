"""Bytes and rates the plan prints, each reproduced from its explain[] arithmetic: parameter all-gathers under
autocast, the ring's attention kernels (A100 and H100), the all-gather CP op's gathered bytes."""

import re
from pathlib import Path

import pytest

from tandem.plan.cost import evaluate
from tandem.plan.explain import explain
from tandem.plan.inputs.args import PlanArgs, resolve, strategy
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import preset
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.params import stage_psi

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt_stdlib.toml"


def _job(tmp_path, parallel: str, dtype: str = "bf16") -> str:
    text = EXAMPLE.read_text().replace("[launch]\n", f"[parallel]\n{parallel}\n[precision]\ndtype = \"{dtype}\"\n"
                                                      "[launch]\n")
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def _plan(**kw):
    m, c, t, v = resolve(PlanArgs(**{"gpu": "a100-80gb", **kw}))
    return evaluate(m, c, t, strategy(v, c, t))


@pytest.mark.parametrize("strat,op", [("zero3", "fsdp-params"), ("zero2", "dp-params"), ("zero1", "dp-params")])
def test_a_job_spec_under_autocast_gathers_fp32_parameters(tmp_path, strat, op):
    """tandem's trainer keeps fp32 parameters under autocast and its FSDP2 has no MixedPrecisionPolicy
    (tandem/train/parallel/fsdp.py): the all-gather moves 4 B a parameter, not the 16-bit 2 B; the same shape
    given as flags (Megatron-style bf16 working weights) still gathers 2 B."""
    p = _plan(config=_job(tmp_path, f'strategy = "{strat}"'))
    assert p.training.autocast and p.training.gather_bytes == 4
    psi = stage_psi(p.model, p.strategy)
    ag = next(o for o in p.comm if o.name == op)
    assert ag.bytes == pytest.approx(psi * 4)
    line = next(x for x in explain(p) if x.startswith(op))
    # the printed arithmetic reproduces the printed bytes: 470.5 k parameters x 4 B = 1.882 MB
    total, n, b = re.search(r"all_gather of ([\d.]+) MB \(([\d.]+) k parameters x (\d) B: fp32", line).groups()
    assert int(b) == 4 and float(total) == pytest.approx(float(n) * 4 / 1e3, rel=1e-3)
    flags = _plan(model="gpt", layers=2, hidden=128, heads=4, seq=64, vocab=256, global_batch=32, micro_batch=16,
                  gpus_per_node=2, zero=int(strat[-1]), precision="bf16")
    assert not flags.training.autocast
    psi = stage_psi(flags.model, flags.strategy)
    assert next(o for o in flags.comm if o.name == op).bytes == pytest.approx(psi * 2)


def test_the_fsdp_gathered_layer_buffer_follows_the_gathered_dtype():
    """ZeRO-3 memory holds the root (embeddings, output layer), the gathered block and the prefetched next one at the
    bytes the gather moves, and the output layer's and one block's unsharded gradients in the stored dtype (fp32
    under autocast: memory.fsdp_inflight_bytes)."""
    m, c = preset("llama2-7b"), make_cluster("a100-80gb", 8, 1)
    s = Strategy(dp=8, zero=3, micro_batch=1)
    half, full = (evaluate(m, c, Training(global_batch=8, autocast=a), s).memory.other for a in (False, True))
    g = m.gpt
    root, block = m.params - g.layers * g.layer_params(), g.layer_params()
    assert full - half == pytest.approx((root + 2 * block + g.vocab * g.hidden + block) * (4 - 2))


def _ring_line(gpu: str, impl: str) -> tuple[str, object]:
    p = _plan(model="llama2-7b", gpu=gpu, gpus_per_node=8, cp=4, seq=32768, global_batch=8, zero=3, cp_impl=impl)
    return next(x for x in explain(p) if x.startswith("cp-ring")), p


@pytest.mark.parametrize("gpu,impl", [("a100-80gb", "torch"), ("a100-80gb", "megatron"), ("h100-sxm", "torch"),
                                      ("h100-sxm", "allgather")])
def test_the_ring_kernels_line_reproduces_attention_time(gpu, impl):
    """The ring's kernel line prints the shares attention_times uses (A100: FlashAttention-2's 0.615 at 2k along
    its curve, no causal figure, so the diagonal block runs on the unmasked curve; H100: the FlashAttention-3
    paper's figures, causal for the diagonal) and sums them to the Compute line's attention seconds."""
    line, p = _ring_line(gpu, impl)
    peak = float(re.search(r"share of the ([\d.]+) TFLOP/s peak", line).group(1)) * 1e12
    terms, f, total = re.search(r"attention = F x \((.*?)\) / peak, F = ([\d.]+) TFLOP of QK\^T and AV forward "
                                r"per GPU a step = ([\d.]+) s, the Compute line's attention", line).groups()
    value = eval(terms.replace(" x ", " * "), {}) * float(f) * 1e12 / peak   # the printed sum, recomputed
    assert value == pytest.approx(p.attn_s, rel=2e-3) and float(total) == pytest.approx(p.attn_s, rel=1e-3)
    if gpu.startswith("a100"):
        # every share printed is 0.615 x curve(L) / curve(2048), and no H100 causal TFLOP/s is named
        shares = re.findall(r"0\.615 x (\d+)/(\d+) = ([\d.]+)", line)
        assert len(shares) == (4 if impl != "allgather" else 2)
        assert all(0.615 * int(a) / int(b) == pytest.approx(float(c), rel=2e-3) for a, b, c in shares)
        assert "causal figure's" not in line and "no causal figure on A100: the unmasked curve" in line
    else:
        shares = re.findall(r"2 x (\d+) / 989\.4 = ([\d.]+) and 2 x (\d+) x 2/2\.5 / 989\.4 = ([\d.]+)", line)
        assert len(shares) == (2 if impl != "allgather" else 1)
        assert all(2 * int(a) / 989.4 == pytest.approx(float(fa), rel=2e-3)
                   and 2 * int(b) * 0.8 / 989.4 == pytest.approx(float(fb), rel=2e-3) for a, fa, b, fb in shares)


def test_allgather_cp_reports_the_gathered_bytes():
    """Meta's all-gather CP: the JSON's bytes per call are the gathered K/V of all cp chunks (the all-gather's
    output, the reduce-scatter's input: collectives.all_gather's convention, as fsdp-params), not one chunk; the collective
    times are those of exactly these bytes, and the explain line prints cp x chunk = gathered."""
    from tandem.plan.terms.collectives import collective
    from tandem.plan.units import si

    line, p = _ring_line("h100-sxm", "allgather")
    o = next(x for x in p.comm if x.name == "cp-ring")
    g = p.model.gpt
    chunk = 2 * p.strategy.micro_batch * (32768 // 4) * g.kv_dim * 2    # K and V of one chunk, bf16
    assert o.bytes == 4 * chunk
    per_layer = collective("all_gather", o.bytes, 1, o.group, p.cluster)[0] \
        + collective("reduce_scatter", o.bytes, 1, o.group, p.cluster)[0]
    assert o.time_s == pytest.approx(g.layers * p.grad_accum * per_layer)
    assert f"4 x {si(chunk)} = {si(4 * chunk)} gathered" in line and f"(4-1)/4 of it, {si(3 * chunk)}" in line
    # the p2p rings keep one chunk per send
    mega = _ring_line("h100-sxm", "megatron")[1]
    assert next(x for x in mega.comm if x.name == "cp-ring").bytes == chunk
