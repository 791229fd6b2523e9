"""tandem diagnose on real 2-rank gloo runs: a profiled window on every rank, faults injected with the
existing 'slow' data fault (a sleep in the loader, both ranks) and a model whose forward sleeps on rank 1.
One faulty run and one balanced run serve every test (module fixtures)."""

import gzip
import json

import pytest

from tandem_testing import ROOT, TINY, run_tandem

pytestmark = pytest.mark.slow

WINDOW = dict(start=3, steps=8)  # 8 steps (~1 s): a burst of load on a few steps is not a finding


def _train(tmp, model: str, env: dict, micro_batch: int = 16) -> tuple:
    run = tmp / "run"
    spec = tmp / "job.toml"
    spec.write_text(TINY.format(model=model, remainder="pad", global_batch=32, micro_batch=micro_batch, max_steps=11,
                                dtype="fp32", every=0, keep=1, nproc=2, run_dir=str(run)))
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", **env}
    p = run_tandem("train", str(spec), "--profile.enabled", "true", "--profile.start_step", str(WINDOW["start"]),
                   "--profile.steps", str(WINDOW["steps"]), "--checkpoint.at_end", "false", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    d = run_tandem("diagnose", str(run), "--json", "--trace", str(tmp / "merged.json.gz"), "--hta", str(tmp / "hta"),
                   env=env)
    assert d.returncode == 0, d.stderr[-3000:]
    return run, json.loads(d.stdout)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """40 ms sleep per batch in the loader on both ranks, 80 ms sleep in rank 1's forward."""
    return _train(tmp_path_factory.mktemp("faulty"), "diagnose.slow_model:factory",
                  {"TANDEM_FAULTS": "slow:rank=0:ms=40,slow:rank=1:ms=40", "SLOW_FORWARD_RANK": "1",
                   "SLOW_FORWARD_MS": "80"})


def _named(rep: dict) -> list:
    """Verdicts that blame a rank's code or data. A straggler whose main thread waited in the run
    queue for most of its excess (cause cpu-starved) is this shared VM's doing (load 10-20 on 2 cores
    while other suites run) and diagnose says so; it is not a finding against the code."""
    return [(v["title"], v["evidence"]) for v in rep["verdicts"]
            if v["kind"] == "data-bound" or (v["kind"] == "straggler" and v["cause"] != "cpu-starved")]


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    """The tiny ResNet, no fault: tens of ms of compute per step; 2 micro-batches a step (MemTracker's
    step then sees each module's forward twice)."""
    return _train(tmp_path_factory.mktemp("balanced"), "resnet18", {}, micro_batch=8)


def test_every_rank_writes_its_window(faulty):
    run, rep = faulty
    for r in (0, 1):
        meta = json.loads((run / "profile" / f"rank-{r}" / "window.json").read_text())
        assert meta["steps"] == list(range(3, 11)) and len(meta["clock_ns"]) == 5
        mem = meta["memory_peak_bytes"]  # MemTracker, the step after the window (the run's last)
        assert meta["memory_step"] == 11 and mem["Parameter"] > 0 and mem["Activation"] > 0, mem
        assert mem["Total"] == sum(v for k, v in mem.items() if k != "Total")
        names = {e.get("name") for e in json.load(gzip.open(run / "profile" / f"rank-{r}" / "trace.json.gz",
                                                           "rt"))["traceEvents"]}
        fr = json.loads((run / "profile" / f"rank-{r}" / "flight_recorder.json").read_text())
        assert any(e["profiling_name"] == "gloo:all_reduce" for e in fr["entries"]), fr
        assert {"ProfilerStep#3", "ProfilerStep#10", "tandem.data", "tandem.forward", "tandem.backward",
                "tandem.optimizer", "tandem.sync", "tandem.clock", "gloo:all_reduce"} <= names
    assert rep["steps"] == list(range(3, 11)) and rep["world"] == 2
    # --hta: a file per rank that names its rank first (as HTA finds it); a CPU run has no datasheet expectation
    hta = {json.load(gzip.open(p, "rt"))["distributedInfo"]["rank"]
           for p in (run.parent / "hta").glob("rank-*.json.gz")}
    assert hta == {0, 1} and rep["hta_traces"]["gpu"] is False
    for r in rep["ranks"]:  # exclusive shares: they add up to the step
        assert r["median"]["shares_from"] == "cpu"
        for s in r["steps"]:
            assert sum(s[f"{c}_pct"] for c in ("data", "compute", "comm", "idle")) == pytest.approx(100, abs=0.01)


def test_sleep_in_the_loader_is_data_bound_on_every_rank(faulty):
    run, rep = faulty
    v = [x for x in rep["verdicts"] if x["kind"] == "data-bound"]
    assert v and v[0]["ranks"] == [0, 1], rep["verdicts"]
    # the trace's data share agrees with the trainer's own timer (metrics.jsonl is rank 0's)
    assert abs(rep["ranks"][0]["median"]["data_pct"] - rep["metrics"]["data_pct"]) < 5.0


def test_sleep_in_rank_1_forward_names_rank_1_and_the_forward(faulty):
    run, rep = faulty
    strag = [(x["ranks"], x["section"], x["cause"]) for x in rep["verdicts"] if x["kind"] == "straggler"]
    assert strag == [([1], "forward", "code-or-device")], rep["verdicts"]  # a sleep is no run-queue wait
    assert rep["sections"]["scores"]["1"]["forward"] < 0.75
    assert rep["sections"]["slowest"]["rank"] == 1
    # rank 0 waits for rank 1 inside the gradient all-reduce: exposed comm on 0, lateness on 1
    assert rep["ranks"][0]["median"]["comm_pct"] > rep["ranks"][1]["median"]["comm_pct"]
    late = [r["lateness_ms"]["per_step"] for r in rep["ranks"]]
    assert late[1] > 40 > late[0], late  # 80 ms of sleep a step, less what rank 0 spent on its own backward
    fr = [r["fr_lateness_ms"]["per_step"] for r in rep["ranks"]]  # torch's flight recorder, by sequence number
    assert fr[1] > 40 > fr[0], fr
    # one host, one clock: offsets 0; the collectives' own estimate is near it (0.001-0.35 ms seen here)
    assert rep["clock"]["method"] == "one-host" and rep["clock"]["matched_collectives"] >= 8
    assert abs(rep["clock"]["estimated_offsets_us"]["1"]) < 2000


def test_balanced_run_names_no_one(balanced):
    """No rank and no section is named. (Communication verdicts are left out here: with the machine
    loaded beyond its 2 cores, gloo's threads wait to be scheduled and a 0.17 MiB all-reduce takes
    1-20 ms, which diagnose reports as exposed communication, as it is.)"""
    run, rep = balanced
    assert not [v for v in rep["verdicts"] if v["kind"] == "data-bound"], rep["verdicts"]
    # On 2 cores shared by 2 ranks, their gloo threads, the agents and pytest, scheduling alone gives a
    # section a score of 0.6-0.75 now and then (seen: forward 11.1 vs 7.6 ms, 1 run in 3), which diagnose
    # reports as a mild straggler. A real one is far below: the sleeping forward above scores 0.01-0.02.
    # A rank the loaded VM starved (load 17 on 2 cores: forward 48.8 vs 7.9 ms, seen) is named with cause
    # cpu-starved, its run-queue wait in the evidence: the host's doing, not a finding against the code.
    starved = {v["ranks"][0] for v in rep["verdicts"] if v.get("cause") == "cpu-starved"}
    strong = [s for s in (rep.get("sections") or {}).get("stragglers", [])
              if s["score"] < 0.5 and s["rank"] not in starved]
    assert not strong, (strong, [(v["title"], v.get("cause"), v["evidence"]) for v in rep["verdicts"]])
    # and no rank makes the others wait half a step (rank 1 with the sleeping forward: ~80 of ~126 ms)
    if not any(v.get("cause") == "cpu-starved" for v in rep["verdicts"]):
        step = max(r["median"]["step_ms"] for r in rep["ranks"])
        late = {r["rank"]: r["lateness_ms"]["per_step"] for r in rep["ranks"]}
        assert max(late.values()) < 0.5 * step, (late, step)
    # the memory table against the plan is there for the tiny ResNet too (measured on the meta device)
    vs = rep["memory_vs_plan"]
    assert vs and "error" not in vs and all(x["ratio"]["params"] == pytest.approx(1.0, abs=0.1)
                                            for x in vs["ranks"].values()), vs
    assert rep["merged_trace"]["bytes"] < 20e6
    # no calibration on CPU: the rate is measured, no datasheet expectation is invented, and the reason is given
    eff = rep["efficiency"]
    assert eff["ranks"]["0"]["flops"] > 0 and "expected_flops" not in eff, eff
    assert "on CPU there is no datasheet peak" in eff["no_expectation"], eff


@pytest.mark.parametrize("run", ["faulty", "balanced"])
def test_no_proposed_setting_is_predicted_slower(run, request):
    """A setting a verdict proposes is one its own step-time model does not predict slower
    (docs/diagnose.md: the verdict then names the fastest what-if, or no change)."""
    _, rep = request.getfixturevalue(run)
    rows = {r["setting"]: r for r in (rep.get("step_time") or {}).get("rows", []) if r.get("vs_now") is not None}
    for v in rep["verdicts"]:
        if v.get("setting"):
            label = " ".join(f"{k} {x:g}" if isinstance(x, (int, float)) else f"{k} {x}" for k, x in v["setting"].items())
            assert label not in rows or rows[label]["vs_now"] <= 1.0, (v, rows.get(label))
        if "rejected" in v:
            assert v["rejected"]["vs_now"] > 1.0 and "not " in v["change"] or "no change found" in v["change"], v
