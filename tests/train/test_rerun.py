"""Running a job again: a finished run trains nothing and keeps its result; a spec that splits
the model another way is refused instead of silently resharding the old run; --fresh moves the
old run aside (nothing deleted) and starts from step 0."""

import json
import shutil

import pytest

from tandem_testing import run_tandem, snapshot

@pytest.fixture(scope="module")
def finished(finished_run):
    return finished_run


def test_a_new_start_appends_after_the_previous_starts_records(tmp_path):
    """A rerun after a stop: the first start's records and logs stay where they are; the new
    start is marked by an ``attempt`` record and readers see its records only."""
    from tandem.core import rundir
    from tandem.train.run import begin_attempt

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "stop", "step": 15, "time": 1}\n')
    (run / "result.json").write_text("{}")
    (run / "logs" / "rank-0.log").write_text("step 15\n")
    assert begin_attempt(run, None) == 2  # a run dir from before attempts were recorded was attempt 1
    assert (run / "metrics.jsonl").read_text().startswith('{"kind": "stop", "step": 15, "time": 1}\n')
    assert (run / "logs" / "rank-0.log").read_text() == "step 15\n" and not (run / "history").exists()
    assert not (run / "result.json").exists()  # it was the previous attempt's; its end record stays in metrics
    assert rundir.read_metrics(run) == []
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "start", "start_step": 15, "time": 2}\n')
    assert [r["kind"] for r in rundir.read_metrics(run)] == ["start"]
    assert begin_attempt(run, run / "checkpoints" / "step-00000015") == 3
    every = rundir.read_metrics(run, all_attempts=True)
    assert [(r["kind"], r.get("attempt")) for r in every] == [("stop", None), ("attempt", 2), ("start", None),
                                                               ("attempt", 3)]
    assert every[-1]["resume"].endswith("step-00000015")
    assert [a["attempt"] for a in rundir.attempts(run)] == [2, 3]
    assert rundir.log_tag(1, 3, 2) == "rank-1.attempt3.restart2" and rundir.log_tag(0, 1, 0) == "rank-0"


@pytest.mark.slow
def test_a_finished_run_trains_nothing_and_keeps_its_result(finished):
    spec, run = finished
    before = snapshot(run)
    r = run_tandem("train", str(spec))
    text = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 0, text
    assert "already complete at step 4: nothing to do" in text and "--fresh" in text, text
    assert snapshot(run) == before  # result.json, metrics, checkpoints: untouched
    r = run_tandem("train", str(spec), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 4, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("override,field,old,new", [
    (("--parallel.strategy", "zero2"), "parallel.strategy", "ddp (tp 1, pp 1)", "zero2 (tp 1, pp 1)"),
])
def test_another_layout_in_the_same_run_dir_is_refused(finished, override, field, old, new):
    spec, run = finished
    before = snapshot(run)
    r = run_tandem("train", str(spec), *override)
    assert r.returncode == 2, r.stdout + r.stderr
    text = " ".join(r.stderr.split())
    assert text.startswith(f"error: {field}: the run dir's checkpoint step-00000004 was trained as {old}, "
                           f"this spec asks for {new}"), text
    assert "--launch.run_dir" in text and "--fresh" in text and "--checkpoint.resume" in text, text
    assert snapshot(run) == before


@pytest.mark.slow
def test_fresh_moves_the_old_run_aside_and_starts_over(finished, tmp_path):
    spec, run = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = snapshot(copy)
    r = run_tandem("train", str(spec), "--fresh", "--launch.run_dir", str(copy), "--data.name", "npz",
                   "--data.path", "/no/such.npz")
    assert r.returncode == 2 and snapshot(copy) == before  # a refused spec moves nothing
    r = run_tandem("train", str(spec), "--fresh", "--launch.run_dir", str(copy))
    assert r.returncode == 0, r.stderr
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.")]
    assert f"--fresh: the previous run in {copy} moved to {moved}" in " ".join(r.stdout.split())
    assert snapshot(moved) == before  # the old run, whole
    starts = [json.loads(l) for l in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [s["start_step"] for s in starts if s["kind"] == "start"] == [0]
    assert json.loads((copy / "result.json").read_text())["step"] == 4
