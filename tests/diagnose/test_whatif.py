"""diagnose's what-ifs: the planner on the run's spec with one setting changed, applied to what was measured."""

import pytest

from diagnose.test_against_plan import _rank, _spec
from tandem.diagnose import against_plan as ap
from tandem.diagnose import whatif

GRAD = 93_824 * 4   # the test GPT's fp32 gradients


def _rep(spec: dict) -> dict:
    peak = {"Parameter": 0.358, "Gradient": 0.0, "Optstate": 0.716, "Activation": 6.0, "Temp": 1.0, "Total": 8.07}
    r = _rank(0, peak, grad_bytes=GRAD)
    r["median"] = {"comm_pct": 50.0, "step_ms": 80.0}
    rep = {"ranks": [r]}
    rep["memory_vs_plan"] = ap.compare(rep, spec)
    return rep


def test_each_alternative_with_memory_bytes_and_calls():
    spec = _spec()
    rep = _rep(spec)
    wi = whatif.table(rep, spec)
    now, rows = wi["now"], {r["setting"]: r for r in wi["rows"]}
    # ring all-reduce over 2 ranks sends 2(n-1)/n = 1x the gradient bytes, in one 25 MiB bucket
    assert now["dp_wire_mib"] == pytest.approx(GRAD / 2**20, rel=1e-3) and now["dp_calls"] == 1
    assert now["exposed_comm_ms"] == pytest.approx(40.0)
    assert set(rows) == {"parallel.strategy zero1", "parallel.strategy zero2", "parallel.strategy zero3",
                         "parallel.activation_checkpoint full", "precision.dtype bf16", "parallel.comm_hook bf16"}
    # zero3 saves half the optimizer state and half the parameters but gathers them: 1.5x the bytes
    z3 = rows["parallel.strategy zero3"]
    assert z3["dp_wire_mib"] == pytest.approx(1.5 * now["dp_wire_mib"], rel=1e-3)
    assert z3["exposed_comm_ms_if_bytes"] == pytest.approx(60.0, rel=1e-3)
    assert z3["peak_mib"] < now["peak_mib"]
    # autocast keeps fp32 gradients: bf16 leaves the bytes alone; the compression hook halves them
    assert "exposed_comm_ms_if_bytes" not in rows["precision.dtype bf16"]
    assert rows["parallel.comm_hook bf16"]["exposed_comm_ms_if_bytes"] == pytest.approx(20.0)
    # full checkpointing saves 1.75 MiB: tandem's GPT runs SDPA, so the plan stores no s x s scores without it
    assert rows["parallel.activation_checkpoint full"]["peak_mib"] < now["peak_mib"] - 1.5


def test_verdicts_that_propose_a_setting_get_the_planner_numbers():
    spec = _spec()
    rep = _rep(spec)
    rep["what_if"] = whatif.table(rep, spec)
    vs = [{"kind": "no-overlap", "evidence": [], "setting": {"parallel.bucket_cap_mb": 0.0895}},
          {"kind": "bandwidth-bound", "evidence": []}]
    whatif.annotate(vs, spec, rep)
    assert vs[0]["evidence"] == ["what-if (planner, this spec): parallel.bucket_cap_mb 0.0895 -> 4 gradient "
                                 "call(s) a step of ~0.0895 MiB (now 1)"]
    assert any("parallel.comm_hook bf16 -> 0.179 MiB" in e and "~20 ms" in e for e in vs[1]["evidence"]), vs[1]
