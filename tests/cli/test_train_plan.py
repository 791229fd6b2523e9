"""plan -> train --plan -> diagnose on one artifact (tandem/cli/train.py, tandem/plan/artifact.py,
tandem/diagnose/against_plan.py): the round trip with real gloo workers, and the refusals, one line each
before any process starts."""

import json
from pathlib import Path

import pytest

from tandem_testing import ROOT, one_line_error, run_tandem

pytestmark = [pytest.mark.slow]
GPT = str(ROOT / "examples" / "gpt_reverse.toml")


def test_plan_train_diagnose_round_trip(tmp_path):
    plan = tmp_path / "p.json"
    r = run_tandem("plan", "--config", GPT, "--zero", "3", "--out", str(plan))
    assert r.returncode == 0, r.stderr
    doc = json.loads(plan.read_text())
    assert doc["strategy"]["zero"] == 3 and doc["trainable"]["ok"]
    run = tmp_path / "run"
    r = run_tandem("train", GPT, "--plan", str(plan), "--schedule.max_steps", "6", "--profile.enabled", "true",
                   "--profile.start_step", "2", "--profile.steps", "2", "--launch.run_dir", str(run))
    assert r.returncode == 0, (r.stdout, r.stderr)
    line = next(x for x in r.stdout.splitlines() if x.startswith("from plan"))
    assert "parallel.strategy zero3 (spec: ddp)" in line and f"schedule.micro_batch {doc['strategy']['micro_batch']}" \
        in line
    spec = json.loads((run / "spec.json").read_text())
    st = doc["strategy"]
    assert spec["parallel"]["strategy"] == "zero3"
    assert (spec["parallel"]["tp"], spec["parallel"]["pp"], spec["parallel"]["cp"]) == (st["tp"], st["pp"], st["cp"])
    assert spec["schedule"]["micro_batch"] == st["micro_batch"]
    assert spec["schedule"]["global_batch"] == st["global_batch"]
    result = json.loads((run / "result.json").read_text())
    assert result["world"] == st["dp"] * st["tp"] * st["pp"] * st["cp"]
    kept = json.loads((run / "from_plan.json").read_text())
    assert kept["strategy"] == st and kept["applied"]["parallel.strategy"] == "zero3"
    assert kept["job"] == doc["job"]

    r = run_tandem("diagnose", str(run))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "Against the plan this run was started from" in r.stdout
    rep = json.loads((run / "diagnose.json").read_text())
    fp = rep["vs_from_plan"]
    assert fp["plan"]["strategy"] == "dp2 tp1 pp1 z3 mb32"
    assert fp["plan"]["mib"]["optimizer"] == pytest.approx(doc["memory_per_gpu"]["optimizer"] / 2**20, rel=1e-3)
    for x in fp["ranks"].values():
        # AdamW's two fp32 moments of a 2-way shard: exact bytes, measured as planned
        assert x["ratio"]["optimizer"] == pytest.approx(1.0, abs=0.02)
        assert sum(x["shares_pct"].values()) == pytest.approx(100, abs=1.0)
    assert sum(fp["plan"]["shares_pct"].values()) == pytest.approx(100, abs=0.01)


def test_plan_refusals_one_line_before_any_process(tmp_path):
    run = tmp_path / "run"

    def train(plan: Path, *extra: str):
        return run_tandem("train", GPT, "--plan", str(plan), "--launch.run_dir", str(run), *extra)

    other_shape = tmp_path / "shape.json"
    assert run_tandem("plan", "gpt", "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "16", "--seq",
                      "16", "--gpus-per-node", "2", "--out", str(other_shape)).returncode == 0
    one_line_error(train(other_shape), "plan:", "another model shape", "layers 4", "layers 2")

    other_world = tmp_path / "world.json"
    assert run_tandem("plan", "--config", GPT, "--nodes", "2", "--micro-batch", "16",
                      "--out", str(other_world)).returncode == 0
    one_line_error(train(other_world), "plan:", "world size 4", "this job has 2")
    # a job of that world passes the check and reaches the spec's own (a command-line override wins over the plan)
    one_line_error(train(other_world, "--launch.nproc_per_node", "4", "--parallel.strategy", "bogus"),
                   "parallel.strategy", "bogus")

    untrainable = tmp_path / "pp.json"
    assert run_tandem("plan", "--config", GPT, "--pp", "2", "--zero", "1", "--micro-batch", "8",
                      "--out", str(untrainable)).returncode == 0
    assert not json.loads(untrainable.read_text())["trainable"]["ok"]
    one_line_error(train(untrainable), "plan:", "cannot train", "zero 1 with pp 2")

    one_line_error(train(ROOT / "examples" / "gpt_reverse.toml"), "plan:", "not a JSON plan")
    assert not run.exists()
