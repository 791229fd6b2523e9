"""`tandem bench train`: a real training run, the planner's prediction, the calibration update."""

from __future__ import annotations

import json

import pytest

from tandem.bench import fit
from tandem.bench.train import TrainBenchOptions
from tandem.core.errors import ConfigError


def test_bad_worker_counts():
    with pytest.raises(ConfigError, match="positive"):
        TrainBenchOptions(workers=[0, 2]).validate()
    with pytest.raises(ConfigError, match="steps"):
        TrainBenchOptions(steps=2).validate()


def test_summary_arithmetic(tmp_path):
    from tandem.bench.train import summarize

    rows = [{"workers": w, "global_batch": 32 * w, "step_s": s, "samples_per_s": 32 * w / s, "ratio": q,
             "calibration_row": w == 1, "model_flops_per_worker": 1e9}
            for w, s, q in ((1, 0.1, 0.8), (2, 0.125, 1.1), (4, 0.2, 1.5), (8, 0.4, 0.7))]
    res = summarize(rows, {}, tmp_path / "c.json")
    assert [round(r["speedup"], 3) for r in res["rows"]] == [1.0, 1.6, 2.0, 2.0]
    assert [round(r["efficiency"], 3) for r in res["rows"]] == [1.0, 0.8, 0.5, 0.25]
    # the calibration row (|0.8 - 1| = 0.2) is not scored: median of 0.1, 0.5, 0.3
    assert res["median_abs_pred_error"] == pytest.approx(0.3) and res["error_rows"] == "predicted"
    only = summarize(rows[:1], {}, tmp_path / "c.json")
    assert only["median_abs_pred_error"] == pytest.approx(0.2) and only["error_rows"] == "all"


def test_model_entry_from_a_run(tmp_path):
    from tandem.bench.train import builtin_spec, model_entry, spec_for, TrainBenchOptions

    spec = spec_for(builtin_spec(), TrainBenchOptions(workers=[1, 2]), 1, tmp_path)
    wdir = tmp_path / "w1"
    wdir.mkdir()
    steps = [0.5, 0.5] + [0.1, 0.3, 0.2, 0.2, 0.1, 0.4, 0.2, 0.2]  # the first fifth (2 of 10) is warm-up
    (wdir / "metrics.jsonl").write_text("".join(json.dumps({"kind": "step", "step": i + 1, "step_time_s": t,
                                                            "data_time_s": 0.0}) + "\n" for i, t in enumerate(steps)))
    # with activation recompute the worker executes more FLOPs than the model's: the rate counts them
    e = model_entry(spec, wdir, {"flops_per_sample": 12e6, "model_flops_per_worker": 32 * 12e6,
                                 "hw_flops_per_worker": 32 * 16e6}, 1.25)
    assert e["step_s"] == pytest.approx(0.2) and e["achieved_flops"] == pytest.approx(32 * 16e6 / 0.2)
    assert e["step_samples_s"] == sorted(steps[2:]) and e["background_threads"] == 1.25
    assert e["threads_per_worker"] == spec.launch.threads_per_worker >= 1 and e["flops_per_sample"] == 12e6


def test_runnable_sampler_background():
    from tandem.bench.train import RunnableSampler

    s = RunnableSampler()
    s.samples = [4, 6, 5]
    assert s.background(own_threads=2) == pytest.approx(2.0)   # 5 - 2 worker threads - 1 sampler
    s.samples = [1, 2]
    assert s.background(own_threads=2) == 0.0
    with RunnableSampler(period_s=0.01) as live:
        while len(live.samples) < 3:  # a real read of /proc/stat (Linux): the sampler itself runs
            pass
    assert min(live.samples) >= 1


@pytest.mark.slow
def test_bench_train_real_run(tmp_path, fake_result):
    from tandem.cli.bench import train_cmd

    cal = tmp_path / "cal.json"
    res = fake_result()
    res["nnodes"], res["world_size"] = 1, 2
    res["rows"] = [r for r in res["rows"] if r["link"] == "intra_node"]
    fit.write_calibration(cal, res)
    # One real run keeps the test short; the scaling arithmetic is tested above.
    train_cmd(config=None, workers="1", steps=6, micro_batch=8, precision="", calibration=cal,
              run_dir=tmp_path / "run", json_out=tmp_path / "r.json")
    out = json.loads((tmp_path / "r.json").read_text())
    rows = out["rows"]
    assert [r["workers"] for r in rows] == [1] and [r["global_batch"] for r in rows] == [8]
    for r in rows:
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0
        assert r["ratio"] == pytest.approx(r["predicted_step_s"] / r["step_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["workers"])
    assert rows[0]["speedup"] == pytest.approx(1.0)
    assert out["median_abs_pred_error"] >= 0
    doc = json.loads(cal.read_text())
    mdl = doc["compute"]["model"]
    assert mdl["achieved_flops"] > 0 and mdl["name"] == "resnet18" and mdl["cores"] >= 1
    assert mdl["achieved_flops"] == pytest.approx(8 * mdl["flops_per_sample"] / mdl["step_s"])
    assert rows[0]["calibration_row"] and rows[0]["ratio"] == pytest.approx(1.0, rel=1e-6)
    assert doc["compute"]["achieved_flops"] == {"fp32": 1e11, "bf16": 2e9}  # the matmul numbers stay


def test_bench_comm_keeps_the_model_entry(tmp_path, fake_result):
    """Re-measuring the links onto a calibration keeps what `bench train` wrote (compute.model)."""
    cal = tmp_path / "cal.json"
    fit.write_calibration(cal, fake_result())
    doc = json.loads(cal.read_text())
    doc["compute"]["model"] = {"name": "resnet18", "flops_per_sample": 1.3e7, "achieved_flops": 4e9}
    cal.write_text(json.dumps(doc))
    res = fake_result()
    res["compute"] = {"achieved_flops": {"fp32": 3e11}}
    fit.write_calibration(cal, res)
    after = json.loads(cal.read_text())["compute"]
    assert after["model"] == doc["compute"]["model"]
    assert after["achieved_flops"] == {"fp32": 3e11, "bf16": 2e9}
