"""diagnose against `tandem plan` for the same spec: the planner's memory next to MemTracker's peak, the
memory verdict and its what-ifs (units on hand-built reports; one slow test on real GPT runs)."""

import json

import pytest

from tandem.core.config import load_spec, to_dict
from tandem.diagnose import against_plan as ap
from tandem_testing import ROOT, run_tandem

MIB = 1 << 20


def _spec(**over) -> dict:
    return to_dict(load_spec(ROOT / "examples" / "gpt_reverse.toml", {k: str(v) for k, v in over.items()}))


def _rank(rank: int, peak_mib: dict, grad_bytes: int = 0, capacity: float | None = None) -> dict:
    return {"rank": rank, "memory": {"step": 9, "peak_mib": peak_mib, "capacity_bytes": capacity},
            "collectives": {"grad_bytes_per_step": grad_bytes}}


def test_plan_for_the_run_spec_is_the_planner_arithmetic():
    """The test GPT: 93,824 parameters; fp32 AdamW: 4 + 4 + 8 bytes each, one shard per rank under zero3."""
    ddp = ap.planned(_spec())
    assert ddp["bytes"]["params"] == 93_824 * 4 and ddp["bytes"]["grads"] == 93_824 * 4
    assert ddp["bytes"]["optimizer"] == 93_824 * 8 and ddp["grad_bytes_per_step"] == 93_824 * 4
    z3 = ap.planned(_spec(**{"parallel.strategy": "zero3"}))
    assert z3["bytes"]["params"] == 93_824 * 4 / 2 and z3["bytes"]["optimizer"] == 93_824 * 8 / 2
    assert z3["bytes"]["gathered"] == 93_824 * 4 / 2   # capped at the rest of the model
    # bf16 autocast keeps fp32 weights, gradients and moments: the same model states
    bf = ap.planned(_spec(**{"precision.dtype": "bf16"}))
    assert bf["bytes"]["params"] == ddp["bytes"]["params"] and bf["bytes"]["optimizer"] == ddp["bytes"]["optimizer"]
    assert bf["bytes"]["activations"] == pytest.approx(ddp["bytes"]["activations"] / 2, rel=0.03)  # fp32 logits (12 B each, unfused loss) stay


def test_ddp_bucket_views_stand_in_for_the_gradients():
    spec = _spec()
    peak = {"Parameter": 0.358, "Gradient": 0.0, "Optstate": 0.716, "Activation": 6.0, "Temp": 1.0, "Total": 8.07}
    rep = {"ranks": [_rank(0, peak, grad_bytes=93_824 * 4)]}
    vs = ap.compare(rep, spec)
    r = vs["ranks"]["0"]
    assert r["ratio"]["grads"] == pytest.approx(1.0) and r["ratio"]["params"] == pytest.approx(1.0, abs=0.01)
    assert r["other_mib"] == pytest.approx(1.0) and any("DDP's buckets" in n for n in vs["notes"])
    assert any("activations" in n for n in vs["notes"])   # 6.0 MiB against 4.66 planned: explained
    assert ap.memory_verdicts({**rep, "memory_vs_plan": vs}, spec) == []   # 2 MiB over a toy plan: no finding


def test_memory_near_capacity_proposes_changes_with_the_planner_numbers():
    spec = _spec()
    peak = {"Parameter": 0.358, "Gradient": 0.358, "Optstate": 0.716, "Activation": 95.0, "Total": 96.4}
    rep = {"ranks": [_rank(0, peak, capacity=100 * MIB), _rank(1, dict(peak, Activation=10.0), capacity=100 * MIB)]}
    rep["memory_vs_plan"] = ap.compare(rep, spec)
    (v,) = ap.memory_verdicts(rep, spec)
    assert v["kind"] == "memory" and v["ranks"] == [0] and v["title"].startswith("memory near capacity")
    assert any("96% of the 100 MiB" in e for e in v["evidence"]), v["evidence"]
    # activations dominate: checkpointing first, then bf16, then zero3; each with the planner's delta
    plan = ap.planned(spec)
    full = ap.planned(spec, {"parallel.activation_checkpoint": "full"})
    delta = (full["bytes"]["activations"] - plan["bytes"]["activations"]) / MIB
    assert v["change"].startswith("parallel.activation_checkpoint full: peak 96.4 MiB -> ~")
    assert f"activations {delta:+.3g} MiB" in v["change"]
    assert "precision.dtype bf16" in v["change"] and "parallel.strategy zero3" in v["change"]
    assert v["change"].index("activation_checkpoint") < v["change"].index("zero3")


def test_memory_well_over_plan_is_a_finding():
    spec = _spec()
    peak = {"Parameter": 0.358, "Gradient": 0.358, "Optstate": 0.716, "Activation": 200.0, "Total": 201.4}
    rep = {"ranks": [_rank(0, peak)]}
    rep["memory_vs_plan"] = ap.compare(rep, spec)
    (v,) = ap.memory_verdicts(rep, spec)
    assert v["title"].startswith("memory over plan") and "x measured/plan" in " ".join(v["evidence"])


def test_a_model_the_planner_cannot_size_is_said_not_raised():
    spec = _spec(**{"model.name": "no_such_module:factory"})
    rep = {"ranks": [_rank(0, {"Parameter": 1.0, "Total": 1.0})]}
    vs = ap.compare(rep, spec)
    assert "error" in vs and "no_such_module" in vs["error"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_gpt_measured_memory_against_the_plan(tmp_path, strategy):
    """Real 2-rank runs of the test GPT: parameters and optimizer state within 10% of the plan (the
    gathered blocks counted under zero3), DDP's gradients too; activations reported with their ratio."""
    run = tmp_path / "run"
    p = run_tandem("train", str(ROOT / "examples" / "gpt_reverse.toml"), "--schedule.max_steps", "5",
                   "--data.held_out", "0", "--profile.enabled", "true", "--profile.start_step", "2",
                   "--profile.steps", "2", "--parallel.strategy", strategy, "--checkpoint.at_end", "false",
                   "--launch.run_dir", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    d = run_tandem("diagnose", str(run), "--html", str(tmp_path / "report.html"))
    assert d.returncode == 0, d.stderr[-3000:]
    assert "Peak memory against the plan" in d.stdout and "What-ifs" in d.stdout, d.stdout
    assert "plan (dp2 tp1 pp1" in (tmp_path / "report.html").read_text()   # the plan's bars under the ranks' 
    rep = json.loads((run / "diagnose.json").read_text())
    vs = rep["memory_vs_plan"]
    for r in vs["ranks"].values():
        assert r["ratio"]["params"] == pytest.approx(1.0, abs=0.1), r
        assert r["ratio"]["optimizer"] == pytest.approx(1.0, abs=0.1), r
        if strategy == "ddp":
            assert r["ratio"]["grads"] == pytest.approx(1.0, abs=0.1), r
        assert 0.5 < r["ratio"]["activations"] < 2.0, r
        assert r["capacity_mib"] and r["capacity_mib"] > r["total_mib"]
    if any(r["ratio"]["activations"] > 1.1 for r in vs["ranks"].values()):
        assert any(n.startswith("activations:") for n in vs["notes"])   # the gap is explained in the report


def _calibration(tmp_path, achieved: float, flops_per_sample: float):
    doc = {"schema": "tandem.calibration/1", "backend": "gloo", "device": "cpu", "world_size": 2, "nnodes": 1,
           "nproc_per_node": 2, "hosts": ["vm"], "device_name": "cpu", "cores": 2,
           "links": {"intra_node": {"bandwidth_Bps": 1e9, "latency_s": 1e-4}},
           "compute": {"achieved_flops": {"fp32": 2e10}, "model": {"name": "gpt", "precision": "fp32", "flops_per_sample": flops_per_sample,
                                 "achieved_flops": achieved, "threads_per_worker": 1, "cores": 2,
                                 "background_threads": 0.0, "step_samples_s": [0.1, 0.1, 0.1]}}}
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps(doc))
    return str(p)


@pytest.mark.parametrize("achieved, finding", [(1e12, True), (1e6, False)])
def test_low_efficiency_against_the_calibrated_rate(tmp_path, achieved, finding):
    """The test GPT, 32 samples a rank a step in 40 ms of data + compute: ~7.3 GFLOP/s. A calibration
    that measured 1 TFLOP/s for this model on one worker makes that a finding; 1 MFLOP/s does not."""
    from tandem.diagnose import efficiency

    spec = _spec()
    fps = efficiency.expected(spec, None)["flops_per_sample"]
    cal = _calibration(tmp_path, achieved, fps)
    rep = {"ranks": [{"rank": k, "main_thread": {"runqueue_ms_per_step": 2.0},
                      "steps": [{"data_ms": 1.0, "compute_ms": 39.0}] * 3} for k in (0, 1)]}
    rep["efficiency"] = e = efficiency.measure(rep, spec, cal)
    assert e["ranks"]["0"]["flops"] == pytest.approx(fps * 32 / 0.040, rel=1e-3)
    assert e["expected_flops"] == pytest.approx(achieved, rel=0.01)   # 2 workers x 1 thread on 2 cores: no sharing
    vs = efficiency.verdicts(rep, spec)
    assert bool(vs) == finding, vs
    if finding:
        assert vs[0]["kind"] == "low-efficiency" and vs[0]["ranks"] == [0, 1]
        assert "threads_per_worker" in vs[0]["change"] and "GFLOP/s" in vs[0]["evidence"][0]


def _eff_report(busy_ms: float) -> dict:
    return {"ranks": [{"rank": k, "median": {"idle_pct": 30.0},
                       "steps": [{"data_ms": 0.0, "compute_ms": busy_ms}] * 3} for k in (0, 1)]}


def test_low_efficiency_without_a_calibration_uses_the_gpu_datasheet():
    """No calibration: an H200 (the name torch reports) is the planner's h200 preset, bf16 peak 989.4
    TFLOP/s x its GPT efficiency 0.508; the test GPT's 32 samples in 1 ms is far below that, and the
    evidence names the datasheet. On CPU there is no preset: the rate is reported, the reason given,
    and no verdict made."""
    from tandem.diagnose import efficiency

    spec = _spec(**{"precision.dtype": "bf16"})
    fps = efficiency.expected(spec, None)["flops_per_sample"]
    h200 = {"device": "cuda:0", "name": "NVIDIA H200"}
    rep = _eff_report(1.0)
    rep["efficiency"] = e = efficiency.measure(rep, spec, None, h200)
    assert e["basis"] == "datasheet" and e["gpu"] == "h200" and e["peak_flops"] == pytest.approx(989.4e12)
    assert e["expected_flops"] == pytest.approx(989.4e12 * 0.508, rel=1e-6)
    assert e["ranks"]["0"]["ratio"] == pytest.approx(fps * 32 / 1e-3 / (989.4e12 * 0.508), rel=1e-3)
    vs = efficiency.verdicts(rep, spec)
    assert [v["kind"] for v in vs] == ["low-efficiency"] and vs[0]["ranks"] == [0, 1]
    ev = " ".join(vs[0]["evidence"])
    assert "h200 datasheet bf16 peak 989.4 TFLOP/s" in ev and "no calibration" in ev and "idle 30.0%" in ev
    assert "threads_per_worker" not in vs[0]["change"] and "micro_batch" in vs[0]["change"]
    # the same rank at 0.6x the expectation: no finding
    fast = _eff_report(fps * 32 / (0.6 * e["expected_flops"]) * 1e3)
    fast["efficiency"] = efficiency.measure(fast, spec, None, h200)
    assert efficiency.verdicts(fast, spec) == []
    for dev, why in (({"device": "cpu", "name": None}, "on CPU there is no datasheet peak"),
                     ({"device": "cuda:0", "name": "Some Future GPU"}, "no planner preset matches")):
        rep = _eff_report(1.0)
        rep["efficiency"] = e = efficiency.measure(rep, spec, None, dev)
        assert "expected_flops" not in e and why in e["no_expectation"] and e["ranks"]["0"]["flops"] > 0
        assert efficiency.verdicts(rep, spec) == []
