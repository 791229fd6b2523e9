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
    from tandem.bench.train import builtin_spec, summarize

    rows = [{"workers": w, "global_batch": 32 * w, "step_s": s, "samples_per_s": 32 * w / s, "ratio": q,
             "model_flops_per_worker": 1e9} for w, s, q in ((1, 0.1, 0.8), (2, 0.125, 1.1), (4, 0.2, 1.5))]
    res = summarize(rows, builtin_spec(), TrainBenchOptions(workers=[1, 2, 4]), tmp_path / "c.json")
    assert [round(r["speedup"], 3) for r in res["rows"]] == [1.0, 1.6, 2.0]
    assert [round(r["efficiency"], 3) for r in res["rows"]] == [1.0, 0.8, 0.5]
    assert res["model"]["achieved_flops"] == pytest.approx(1e10)
    assert res["median_abs_pred_error"] == pytest.approx(0.2)


@pytest.mark.slow
def test_bench_train_real_run(tmp_path, fake_result):
    from tandem.bench.cli import train_cmd

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
    assert doc["compute"]["model"]["achieved_flops"] > 0 and doc["compute"]["model"]["name"] == "resnet18"
    assert doc["compute"]["achieved_flops"] == {"fp32": 1e11, "bf16": 2e9}  # the matmul numbers stay
