"""FSDP's own copies (tandem/plan/terms/fsdp_copies.py): bytes per unsharded parameter a micro-batch by implementation,
where they are charged (compute stream vs before each reduce-scatter), the explain line's arithmetic, the flag."""

import re

import pytest
from typer.testing import CliRunner

from tandem.cli import app
from tandem.core.errors import ConfigError
from tandem.plan.cost import evaluate
from tandem.plan.explain import explain
from tandem.plan.explain_compute import pipeline_line
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import preset
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms import fsdp_copies as FR


def test_bytes_per_parameter_by_implementation():
    # FSDP1: the views' gradients concatenated (2p) on the compute stream; the pre-divide (2r) before the
    # reduce-scatter, with a cast (p + r) when the reduce dtype differs
    assert FR.copy_bytes("fsdp1", 2, 2) == (4, 4)
    assert FR.copy_bytes("fsdp1", 2, 4) == (4, 6 + 8)
    # FSDP2: copy-out at each of two gathers (2 x 2p) + the reduce-scatter copy-in (p + r); NCCL divides bf16
    assert FR.copy_bytes("fsdp2", 2, 2) == (12, 0)
    assert FR.copy_bytes("fsdp2", 2, 4) == (14, 0)
    assert FR.copy_bytes("fsdp2", 2, 2, fp16_reduce=True) == (12, 4)


def _plan(fsdp: str, zero: int = 3, mb: int = 2):
    m = preset("llama2-7b")
    c = make_cluster("a100-80gb", 8, 2)
    t = Training(global_batch=16 * mb, precision="bf16", flash_attention=True, fsdp=fsdp)
    return m, evaluate(m, c, t, Strategy(dp=16, zero=zero, micro_batch=1))


def test_charged_per_micro_batch_on_zero3_only():
    bw = 0.9 * 2039e9
    m, p1 = _plan("fsdp1")
    assert abs(p1.fsdp_copy_s - m.params * 4 / bw * 2) < 1e-9 * p1.fsdp_copy_s   # 2 micro-batches
    _, p2 = _plan("fsdp2")
    assert abs(p2.fsdp_copy_s / p1.fsdp_copy_s - 3) < 1e-9
    assert abs((p2.compute_s - p1.compute_s) - (p2.fsdp_copy_s - p1.fsdp_copy_s)) < 1e-12
    # FSDP1's pre-divide lengthens each reduce-scatter (hidden here), FSDP2's does not exist for bf16
    rs1 = next(o for o in p1.comm if o.name == "dp-grad")
    rs2 = next(o for o in p2.comm if o.name == "dp-grad")
    assert rs1.time_s > rs2.time_s
    assert _plan("fsdp1", zero=2)[1].fsdp_copy_s == 0.0
    assert Training(global_batch=1).fsdp == "fsdp2"   # tandem's trainer and torchtitan: fully_shard


def test_explain_line_reproduces_its_number():
    _, p = _plan("fsdp1")
    line = next(x for x in explain(p) if x.startswith("FSDP copies"))
    nums = re.search(r"= (\d+) B per unsharded parameter .* x ([\d.]+)B parameters x (\d+) micro-batch\(es\) at "
                     r"([\d.]+) x ([\d.]+) TB/s = ([\d.]+) ms", line)
    b, params, mb, share, tbs, msec = (float(x) for x in nums.groups())
    assert abs(b * params * 1e9 * mb / (share * tbs * 1e12) * 1e3 - msec) < 0.01 * msec
    assert "counted in its r" in line   # the pre-divide's block time


def test_cli_flag_and_bad_value():
    base = ["plan", "llama2-7b", "--gpu", "a100-80gb", "--gpus-per-node", "8", "--nodes", "2", "--zero", "3",
            "--global-batch", "32"]
    out = CliRunner().invoke(app, [*base, "--fsdp", "fsdp1", "--json"])
    assert out.exit_code == 0, out.output
    assert '"fsdp": "fsdp1"' in out.output and '"fsdp_copy_s"' in out.output
    bad = CliRunner().invoke(app, [*base, "--fsdp", "zero"])
    assert isinstance(bad.exception, ConfigError) and bad.exception.field == "fsdp", bad.output   # exit 2 in tandem


def _pp_plan(sync: str, autocast: bool = False, schedule: str = "1f1b"):
    m = preset("llama2-7b")
    c = make_cluster("h100-sxm", 8, 4)
    t = Training(global_batch=64, precision="bf16", attention_kernel="fa2", pp_grad_sync=sync, autocast=autocast)
    pipe = dict(schedule="interleaved", virtual=2) if schedule == "interleaved" else {}
    return evaluate(m, c, t, Strategy(dp=8, pp=4, zero=3, micro_batch=1, ranks_per_node=8, **pipe))


def test_under_a_pipeline_the_copies_run_once_per_reduction():
    """torch's pipelining keeps FSDP2 unsharded and skips gradient sync until the last backward (stage.py): with
    pp_grad_sync step one copy-out (2p) and one copy-in (p + r) a step; round: a copy-in a round; microbatch: as
    every micro-batch (2 gathers x 2p + p + r) x m."""
    per_mb, step = _pp_plan("microbatch"), _pp_plan("step")
    assert per_mb.grad_accum == 8
    # bf16 parameters, r = 2 (FSDP2 reduces in the parameter dtype): 12 B x 8 against 2p + (p + r) = 8 B
    assert per_mb.fsdp_copy_s / step.fsdp_copy_s == pytest.approx(12 * 8 / 8)
    rnd = _pp_plan("round", schedule="interleaved")   # 8 micro-batches, pp 4: 2 rounds
    assert FR.times(rnd.model, rnd.training, rnd.strategy, 8) == 2
    inter = _pp_plan("step", schedule="interleaved")
    assert rnd.fsdp_copy_s / inter.fsdp_copy_s == pytest.approx((4 + 2 * 4) / (4 + 4))
    line = next(x for x in explain(step) if x.startswith("FSDP copies"))
    b, psi, bw, share, msec = re.search(r"= ([\d.]+) B per unsharded parameter a step .* x ([\d.]+)B parameters at "
                                        r"([\d.]+) x ([\d.]+) TB/s = ([\d.]+) ms", line).groups()
    assert float(b) == 8 and float(psi) * 1e9 * 8 / (float(bw) * float(share) * 1e12) * 1e3 == \
        pytest.approx(float(msec), rel=0.01)


def test_autocast_copies_move_fp32_parameters_and_gradients():
    """Under autocast the parameters are fp32 (config.Training.gather_bytes) and FSDP2 has no mixed-precision
    policy: 2 gathers x 2 x 4 B + (4 + 4) = 24 B per parameter, twice the bf16 working copy's 12."""
    m = preset("llama2-7b")
    c = make_cluster("a100-80gb", 8, 2)
    s = Strategy(dp=16, zero=3, micro_batch=1)
    half, full = (evaluate(m, c, Training(global_batch=32, precision="bf16", attention_kernel="fa2", autocast=a), s)
                  for a in (False, True))
    assert full.fsdp_copy_s / half.fsdp_copy_s == pytest.approx(24 / 12)
    line = next(x for x in explain(full) if x.startswith("FSDP copies"))
    assert "= 24 B per unsharded parameter (p = 4 B, r = 4 B)" in line


def test_pipeline_line_fill_excludes_the_copies():
    """The bubble is computed before the copies are added to compute (cost.evaluate), so the pipeline line's
    mean-stage micro-batch time leaves them out: fill x per micro-batch reproduces the bubble, fill = p - 1."""
    p = _pp_plan("microbatch")
    assert p.fsdp_copy_s > 0
    line = pipeline_line(p)
    fill, per_mb = re.search(r"fill and drain ([\d.]+) mean-stage micro-batch times .*? x ([\d.]+) ms", line).groups()
    assert float(fill) == pytest.approx(3, rel=0.02)   # p - 1, equal stages but the embedding / logits
    assert float(fill) * float(per_mb) == pytest.approx((p.bubble_s - p.bubble_comm_s) * 1e3, rel=0.01)


def test_deferred_sync_holds_no_extra_gather_buffers():
    """Under pp_grad_sync step|round a ZeRO-3 stage's parameters are already counted unsharded (memory.params),
    so "other" adds no gathered + prefetched layer; per micro-batch it does."""
    from tandem.plan.terms.memory import CONTEXT_BYTES

    for sync, sched in (("step", "1f1b"), ("round", "interleaved")):
        p = _pp_plan(sync, schedule=sched)
        assert p.memory.other == CONTEXT_BYTES
    assert _pp_plan("microbatch").memory.other > CONTEXT_BYTES


def _zero2_pipeline_plans() -> dict:
    """GPT-3 175B at ZeRO-2 under a pipeline (dp 8, tp 8, pp 8), gradients reduced once a step or each micro-batch."""
    m = preset("gpt3-175b")
    c = make_cluster("a100-80gb", 8, 64)
    s = Strategy(dp=8, tp=8, pp=8, zero=2, micro_batch=1, ranks_per_node=8)
    return {sync: evaluate(m, c, Training(global_batch=512, precision="bf16", attention_kernel="fa2",
                                          pp_grad_sync=sync), s)
            for sync in ("step", "microbatch")}


def test_zero2_deferred_gathers_parameters_behind_the_first_forward():
    """ZeRO-2 under pp_grad_sync step is FSDP2 with reshard_after_forward=False under torch's pipelining: the
    parameters are gathered at the first forward, prefetched from FSDP2's all-gather stream, as the grad-sync
    rule says; per micro-batch (Megatron's distributed optimizer without --overlap-param-gather) after the step."""
    rule = {}
    for sync, p in _zero2_pipeline_plans().items():
        op = next(o for o in p.comm if o.name == "dp-params")
        rule[sync] = (op.rule, op.exposed_s < op.time_s)
    assert rule == {"step": ("prefetch", True), "microbatch": ("none", False)}


def test_zero2_deferred_lines_name_torchs_fp32_reduction_and_bucket_calls():
    """The gradient line under ZeRO-2 + step names FSDP2's reduce_dtype (torch's pipelining), not Megatron's
    distributed optimizer; the once-a-step reduce-scatter (rule none) counts its buckets as bucket calls."""
    lines = {sync: explain(p) for sync, p in _zero2_pipeline_plans().items()}
    grads = {k: next(x for x in v if x.startswith("Gradients per GPU")) for k, v in lines.items()}
    assert "FSDP2's reduce_dtype" in grads["step"] and "Megatron" not in grads["step"]
    assert "Megatron-LM's distributed optimizer" in grads["microbatch"]
    rs = next(x for x in lines["step"] if x.startswith("dp-grad"))
    assert re.search(r"x 1 call\(s\) per step in \d+ bucket calls ", rs), rs
