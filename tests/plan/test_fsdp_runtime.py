"""FSDP's own copies (tandem/plan/fsdp_runtime.py): bytes per unsharded parameter a micro-batch by implementation,
where they are charged (compute stream vs before each reduce-scatter), the explain line's arithmetic, the flag."""

import re

from typer.testing import CliRunner

from tandem.cli import app
from tandem.core.errors import ConfigError
from tandem.plan import fsdp_runtime as FR
from tandem.plan.config import Strategy, Training
from tandem.plan.cost import evaluate
from tandem.plan.explain import explain
from tandem.plan.hardware import make_cluster
from tandem.plan.model import preset


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
