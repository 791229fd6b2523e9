"""calibration compute.model (`tandem bench train`'s 1-worker row): round trip, arithmetic, bad input."""

import json

import pytest

from tandem.core.errors import ConfigError
from tandem.plan.cost import evaluate
from tandem.plan.inputs import calibration
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.host_model import ModelCalibration
from tandem.plan.inputs.model import ModelStats
from tandem.plan.inputs.training import Strategy, Training

FWD = 4e6  # forward FLOPs per sample of the test model: 12 MFLOP per training sample


def model_entry(**over):
    e = {"name": "tiny", "precision": "fp32", "flops_per_sample": 3 * FWD, "achieved_flops": 4e9,
         "threads_per_worker": 1, "cores": 2, "background_threads": 0.0,
         "step_samples_s": [0.09, 0.1, 0.1, 0.11, 0.2]}
    e.update(over)
    return e


def cal_doc(entry):
    return {"schema": "tandem.calibration/1", "host": "h", "backend": "gloo", "device": "cpu", "world_size": 2,
            "nnodes": 1, "links": {"intra_node": {"bandwidth_Bps": 1e9, "latency_s": 1e-3, "group_size": 2}},
            "compute": {"achieved_flops": {"fp32": 5e10}, "model": entry}}


def load(tmp_path, entry, gpn=2):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal_doc(entry)))
    return calibration.load(p, make_cluster(gpus_per_node=gpn))


def tiny():
    return ModelStats("tiny", "cnn", 1_000_000, FWD)


def test_round_trip(tmp_path):
    c = load(tmp_path, model_entry(background_threads=1.5))
    h = c.host_model
    assert (h.name, h.precision, h.flops_per_sample, h.achieved_flops) == ("tiny", "fp32", 12e6, 4e9)
    assert (h.threads, h.cores, h.background, h.device) == (1, 2, 1.5, "cpu")
    assert h.step_samples == (0.09, 0.1, 0.1, 0.11, 0.2)
    assert any("tiny (fp32) measured at 4 GFLOP/s" in n for n in c.notes)


def test_measured_flops_replace_matmul_times_efficiency(tmp_path, ):
    c = load(tmp_path, model_entry(), gpn=1)
    t = Training(global_batch=32, precision="fp32")
    p = evaluate(tiny(), c, t, Strategy(dp=1))
    # 32 samples x 12 MFLOP / 4 GFLOP/s, efficiency 1: not 5e10 x 0.18/0.8
    assert p.compute_s == pytest.approx(32 * 12e6 / 4e9)
    assert p.efficiency == 1.0 and p.host_factors == (1.0, 1.0)
    # another model (or precision) keeps the matmul x efficiency arithmetic
    other = evaluate(ModelStats("other", "cnn", 1_000_000, FWD), c, t, Strategy(dp=1))
    assert other.host_factors is None
    assert other.compute_s == pytest.approx(32 * 12e6 / (5e10 * 0.18 / 0.8))
    bf = evaluate(tiny(), c, Training(global_batch=32, precision="bf16"), Strategy(dp=1))
    assert bf.host_factors is None


def test_core_sharing_and_stragglers(tmp_path):
    c = load(tmp_path, model_entry(background_threads=1.0), gpn=4)
    p = evaluate(tiny(), c, Training(global_batch=4 * 32, precision="fp32", threads_per_worker=1), Strategy(dp=4))
    # 4 workers x 1 thread + 1 other on 2 cores vs 1 + 1 on 2: max(2, 5) / max(2, 2) = 2.5
    share = 5 / 2
    # median of the max of 4 draws: quantile 0.5**(1/4) = 0.8409 of the 5 samples
    pos = 0.5 ** 0.25 * 4
    q = 0.11 + (0.2 - 0.11) * (pos - 3)
    strag = q / 0.1
    assert p.host_factors == pytest.approx((share, strag))
    assert p.compute_s == pytest.approx(32 * 12e6 / 4e9 * share * strag)
    assert p.step_s == pytest.approx(p.compute_s + p.exposed_comm_s)
    # two workers on two cores, nobody else: no sharing; default threads = cores / workers = 1
    c2 = load(tmp_path, model_entry(), gpn=2)
    p2 = evaluate(tiny(), c2, Training(global_batch=64, precision="fp32"), Strategy(dp=2))
    assert p2.host_factors[0] == 1.0


def test_gpu_calibration_has_no_core_sharing():
    h = ModelCalibration.from_doc(model_entry(), "cuda")
    assert h.core_slowdown(8, 4) == 1.0
    assert h.straggler_factor(1) == 1.0


def test_older_model_entry_is_ignored_with_a_note(tmp_path):
    c = load(tmp_path, {"name": "resnet18", "width": 16, "precision": "fp32", "micro_batch": 32, "step_s": 0.05,
                        "achieved_flops": 7e9})
    assert c.host_model is None and any("older" in n for n in c.notes)


@pytest.mark.parametrize("bad, key", [({"achieved_flops": -1}, "achieved_flops"), ({"cores": 0}, "cores"),
                                      ({"background_threads": -0.5}, "background_threads"),
                                      ({"name": ""}, "name"), ({"step_samples_s": [0.1, "x"]}, "step_samples_s"),
                                      ({"threads_per_worker": True}, "threads_per_worker")])
def test_bad_model_entry(tmp_path, bad, key):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, model_entry(**bad))
    assert e.value.field == "calibration" and key in str(e.value)


def test_bad_threads_per_worker():
    with pytest.raises(ConfigError) as e:
        Training(threads_per_worker=0)
    assert e.value.field == "threads-per-worker"


def test_plan_cli_uses_the_measured_model(tmp_path):
    """`tandem plan --config SPEC --calibration FILE` on the job bench train measures: the model matches."""
    from typer.testing import CliRunner

    from tandem.bench.train import TrainBenchOptions, builtin_spec, spec_for
    from tandem.cli import app
    from tandem.core.config import to_dict
    import yaml

    spec = spec_for(builtin_spec(), TrainBenchOptions(workers=[1, 4]), 4, tmp_path)
    sp = tmp_path / "spec.yaml"
    sp.write_text(yaml.safe_dump(to_dict(spec)))
    from tandem.plan.inputs.args import PlanArgs, resolve
    flops = resolve(PlanArgs(config=str(sp)))[0].flops_per_sample
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(cal_doc(model_entry(name="resnet18", flops_per_sample=flops))))
    r = CliRunner().invoke(app, ["plan", "--config", str(sp), "--calibration", str(cal), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["cluster"]["compute_from"] == "cpu workers, measured (resnet18)"
    table = CliRunner().invoke(app, ["plan", "--config", str(sp), "--calibration", str(cal)], env={"COLUMNS": "200"})
    title = table.output.splitlines()[[i for i, l in enumerate(table.output.splitlines()) if "┏" in l][0] - 1]
    assert "1x4 cpu workers, measured (resnet18) (loopback/gloo (measured))" in title  # not an A100 in the title
    tm = json.loads(r.output)["time"]
    assert tm["host_core_slowdown"] == pytest.approx(4 * spec.launch.threads_per_worker / 2)
    assert tm["compute_s"] == pytest.approx(32 * flops / 4e9 * tm["host_core_slowdown"] * tm["host_straggler_factor"])
    bad = cal_doc(model_entry(name="resnet18", flops_per_sample=flops, cores="two"))
    cal.write_text(json.dumps(bad))
    r = CliRunner().invoke(app, ["plan", "--config", str(sp), "--calibration", str(cal)])
    assert isinstance(r.exception, ConfigError) and "compute.model.cores" in str(r.exception)
