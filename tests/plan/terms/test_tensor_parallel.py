"""--tp-overlap (tandem/plan/terms/tensor_parallel.py): what each mode leaves exposed, its explain line's arithmetic, the rule that
a tensor-parallel group across nodes is not overlapped, and torchtitan's published async-TP pairs.

The published pairs (TPS/GPU without and with async TP, same job, same Grand Teton H100s):
- torchtitan docs/performance.md at eaea6f6a, Table 4: Llama 3.1 70B, 256 GPUs (FSDP 32, TP 8), torch.compile +
  Float8, full AC, local batch 16: 2D 829, 2D + AsyncTP 876 (1.057x); torch 1963fc8 (2024-12-23).
- torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: the same 70B job (torch.compile, full AC, local
  batch 16) in BF16 597.3 -> 652.4 (1.09x) and Float8 tensorwise 809.8 -> 942.4 (1.16x); Llama 3.1 8B on 64 GPUs
  (FSDP 8, TP 8, per-op SAC, local batch 12) BF16 4378 -> 4809.4 (1.10x), Float8 tensorwise 5078.1 -> 5570.1
  (1.10x); torch 38410cf9 (2025-06-14). (Float8 rowwise left out: its baseline is the slow one, torchtitan #1207.)
Measured when written: the planner's speedup with ``ring`` is 1.188x on the Table 4 pair (+12.4% over 1.057x),
and 1.145x / 1.188x / 1.154x / 1.159x on the 2025 pairs (+4.8%, +2.1%, +5.1%, +5.7%): the ring rule hides more
than torch's async TP did, most of all in December 2024: median 5.0%, max 12.4%, within the issue's tolerance (10% /
25%), but every pair over-stated; pinned just above. Term behind it: what torch's decomposed collectives leave
exposed (the SM cost and the tp-times-smaller GEMM chunks, not charged). That is also why torchtitan's T5/T6 rows, which ran AsyncTP, are planned without it
(tests/plan/test_published_torchtitan.py). The vanilla 70B BF16 row alone, with nothing overlapped: 601 TPS/GPU
predicted against 597.3 (+0.6%) when written; re-measured on today's main (f1c4484 and the FSDP-copies fix): 600
(+0.4%), and the pairs +12.4%, +4.8%, +2.0%, +5.0%, +5.6% (median 5.0%, max 12.4%).
"""

import dataclasses
from statistics import median

import pytest

from tandem.core.errors import ConfigError
from tandem.plan.cost import evaluate
from tandem.plan.explain import explain
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import GPTShape, gpt_stats
from tandem.plan.inputs.training import TP_OVERLAP, Strategy, Training
from tandem.plan.terms import tensor_parallel as TPO
from tests.plan import test_published_torchtitan as TT

# label, model, GPUs, dp, local batch, recompute, precision, kernels, TPS/GPU vanilla TP, with async TP
PAIRS = [
    ("T4 eaea6f6a 70B fp8", "llama3.1-70b", 256, 32, 16, "full", "fp8", None, 829, 876),
    ("2025-06 70B bf16", "llama3.1-70b", 256, 32, 16, "full", "bf16", "compiled", 597.3, 652.4),
    ("2025-06 70B fp8", "llama3.1-70b", 256, 32, 16, "full", "fp8", None, 809.8, 942.4),
    ("2025-06 8B bf16", "llama3.1-8b", 64, 8, 12, "selective", "bf16", "compiled", 4378, 4809.4),
    ("2025-06 8B fp8", "llama3.1-8b", 64, 8, 12, "selective", "fp8", None, 5078.1, 5570.1),
]


def _tps(row, mode):
    _, name, gpus, dp, local, rc, prec, kernels, _, _ = row
    p = TT._plan(name, 8192, "h100-sxm-500w", gpus, "ib-ndr", dp, 8, 1, 1, local, rc, prec, kernels=kernels)
    q = evaluate(p.model, p.cluster, dataclasses.replace(p.training, tp_overlap=mode), p.strategy)
    return local * dp * 8192 / q.step_s / gpus


def speedup_errors() -> dict[str, float]:
    return {r[0]: (_tps(r, "ring") / _tps(r, "none")) / (r[-1] / r[-2]) - 1 for r in PAIRS}


def SCOREBOARD() -> dict[str, dict]:
    return {"async-TP speedup (tt)": speedup_errors()}


def _gpt_plan(mode, nodes=1, tp=8, recompute="none"):
    m = gpt_stats(GPTShape(layers=8, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq=4096, vocab=32000,
                           gated=True, bias=False, tied=False, learned_pos=False), "t")
    c = make_cluster("h100-sxm", 8, nodes, inter="ib-ndr", nics_per_node=8)
    s = Strategy(dp=8 * nodes // tp, tp=tp, zero=1, micro_batch=1, recompute=recompute, ranks_per_node=8)
    p = evaluate(m, c, Training(global_batch=8 * 8 * nodes // tp, tp_overlap=mode, attention_kernel="cudnn"), s)
    return p, next(o for o in p.comm if o.name == "tp-activations")


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_each_mode_hides_more_and_none_charges_everything(recompute):
    (pn, n), (pb, b), (pr, r) = (_gpt_plan(m, recompute=recompute) for m in TP_OVERLAP)
    assert n.exposed_s == n.time_s == b.time_s == r.time_s > 0
    assert n.exposed_s > b.exposed_s > r.exposed_s > 0   # the last split of each forward scatter stays exposed
    assert pn.step_s - pr.step_s == pytest.approx(n.exposed_s - r.exposed_s)
    # ring: at least the last split a/4 of each forward scatter (2 a layer, per forward pass), 8 layers
    fwd = 2 if recompute == "full" else 1
    one = n.time_s / n.calls
    assert r.exposed_s >= fwd * 2 * one / 2 / TPO.RS_SPLITS * 8 * pr.grad_accum * (1 - 1e-9)


def test_explain_line_reproduces_the_exposed_time():
    for mode in ("bulk", "ring"):
        p, o = _gpt_plan(mode)
        line = next(x for x in explain(p) if x.startswith("tp-activations"))
        one, gemms, layers, mb, full = o.detail
        assert o.exposed_s == pytest.approx(TPO.exposed_per_layer(mode, one, 8, gemms, full) * layers * mb)
        assert f"{o.exposed_s * 1e3:.3g} ms exposed" in line, line
        assert f"x {layers} layers x {mb} micro-batches" in line
    _, o = _gpt_plan("ring")
    parts = TPO.ring_parts(o.detail[0], 8, o.detail[1])
    assert sum(parts) == pytest.approx(o.exposed_s / (o.detail[2] * o.detail[3]))


def test_a_tensor_parallel_group_across_nodes_is_not_overlapped():
    """Userbuffers and symmetric memory need the tp group in one NVLink domain: tp 16 on 8-GPU nodes is charged in
    full whatever --tp-overlap says."""
    _, o = _gpt_plan("ring", nodes=2, tp=16)
    assert o.group.nodes == 2 and o.exposed_s == o.time_s and o.rule == "none"


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        Training(tp_overlap="userbuffers")
    assert e.value.field == "tp-overlap" and "ring" in e.value.fix


def test_async_tp_speedup_over_stated_within_tolerance():
    """The ring rule over-states torch's async-TP speedup, by 12.4% on torchtitan's December 2024 pair and 2-6% on
    its June 2025 ones (module docstring): within the issue's 10% / 25%, every predicted speedup above the published
    one; pinned just above."""
    errs = speedup_errors()
    assert all(e > 0 for e in errs.values()), errs
    assert max(errs.values()) <= 0.13, errs
    assert median(errs.values()) <= 0.055, errs


def test_vanilla_70b_bf16_row_without_overlap():
    """The 2025 benchmark's 70B BF16 baseline (vanilla TP) as a plain row: within 2%."""
    assert _tps(PAIRS[1], "none") / PAIRS[1][-2] - 1 == pytest.approx(0.004, abs=0.016)


def test_cli_flag_reaches_the_plan():
    import json

    from tests.plan.test_cli import invoke

    base = ["gpt3-175b", "--gpu", "h100-sxm", "--nodes", "16", "--nics-per-node", "8", "--global-batch", "512",
            "--tp", "8", "--pp", "8", "--micro-batch", "1", "--json"]
    ops = {}
    for mode in ("none", "ring"):
        r = invoke(*base, "--tp-overlap", mode)
        assert r.exit_code == 0, r.output
        ops[mode] = next(o for o in json.loads(r.output)["comm"] if o["name"] == "tp-activations")
    assert ops["none"]["exposed_s"] == ops["none"]["time_s"] and ops["none"]["overlap"] == "none"
    assert ops["ring"]["exposed_s"] < ops["ring"]["time_s"] / 4 and ops["ring"]["overlap"] == "tp-ring"
    r = invoke(*base, "--tp-overlap", "rings")
    assert r.exit_code != 0 and r.exception.field == "tp-overlap"
