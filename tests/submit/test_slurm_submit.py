"""`tandem submit --on slurm` on a real 2-node Slurm cluster (Debian's slurmctld/slurmd/munged on loopback).

The cluster comes up once for this module (tests/slurm_cluster.py, about 1-4 s) and every
daemon, slurmstepd and job task is killed at teardown. Outside CI the tests skip, with the
reason, where Slurm's packages cannot be fetched; in CI (CI=true) they must run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from slurm_cluster import SlurmCluster, slurm_root
from tandem_testing import ROOT, TINY, run_tandem, skip_here_fail_in_ci, wait_for

pytestmark = pytest.mark.slow
SLEEPER = "import pathlib, sys, time\npathlib.Path(sys.argv[1]).touch()\ntime.sleep(600)\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root, why = slurm_root()
    if root is None:
        skip_here_fail_in_ci(why, "the Slurm tests")
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), root) as c:
        yield c
    assert not c.strays(), "Slurm processes left behind"


def tandem(cluster, *args, env=None, timeout=120):
    full = {k: cluster.env[k] for k in ("SLURM_CONF", "LD_LIBRARY_PATH", "PATH")}
    return run_tandem(*args, env={**full, **(env or {})}, timeout=timeout, cwd=ROOT)


def submit(cluster, run_dir, *args, env=None):
    r = tandem(cluster, "submit", "--on", "slurm", "--run-dir", str(run_dir), *args, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("submitted: slurm job "), r.stdout
    return r.stdout.split()[3]


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """The module's three jobs in the default partition, submitted at once (they run side by side: 4 CPUs per
    node, 1 per job)."""
    d = tmp_path_factory.mktemp("jobs")
    script = d / "sleeper.py"
    script.write_text(SLEEPER)
    return {"hello": (d / "hello", submit(cluster, d / "hello", "--nodes", "2", "--nproc-per-node", "2",
                                          "examples/hello_dist.py")),
            "fail": (d / "fail", submit(cluster, d / "fail", "--nodes", "2", "--max-requeues", "1",
                                        "examples/hello_dist.py", env={"HELLO_FAIL_RANK": "1"})),
            "sleep": (d / "sleep", submit(cluster, d / "sleep", "--nodes", "2", str(script), str(d / "started"))),
            "started": d / "started", "script": script}


def wait_state(cluster, run_dir, job_id, states, timeout=180):
    """Poll the controller (scontrol, not a sleep) until the job reaches one of ``states``; then `tandem status`."""
    def state():
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster.env, capture_output=True,
                             text=True).stdout
        return next((s for s in states if f"JobState={s} " in out), None)
    wait_for(state, timeout, f"slurm job {job_id} to reach {states}", interval=0.2)
    return tandem(cluster, "status", str(run_dir))


def test_submit_two_nodes_runs_four_ranks(cluster, jobs):
    run, job_id = jobs["hello"]
    st = wait_state(cluster, run, job_id, ["COMPLETED", "FAILED", "CANCELLED"])
    assert st.returncode == 0 and st.stdout.startswith(f"slurm job {job_id}: COMPLETED; nodes n[1-2]; requeued 0 "
                                                       "time(s); exit 0:0, run time "), st.stdout
    out = (run / "submit" / f"slurm-{job_id}.out").read_text()
    ranks = sorted(ln for ln in out.splitlines() if "all_reduce sum" in ln)
    assert len(ranks) == 4 and all("sum 6 (expect 6)" in ln for ln in ranks), out
    assert {ln.split()[3] for ln in ranks} == {"0", "1"}  # "node K": both nodes' agents took part
    assert sorted(p.name for p in (run / "logs").glob("rank-?.log")) == [f"rank-{i}.log" for i in range(4)]


def test_failed_rank_is_named_and_not_requeued(cluster, jobs):
    run, job_id = jobs["fail"]
    st = wait_state(cluster, run, job_id, ["COMPLETED", "FAILED", "CANCELLED"])
    assert st.returncode == 1 and ": FAILED;" in st.stdout, st.stdout
    assert "requeued 0 time(s)" in st.stdout  # the other node's SIGTERM (exit 143) is not a preemption
    # the root cause by its rank, node and exception; its exit status is 1, or the agent's SIGTERM (-15)
    # when a peer's failure reached the agent while it was still exiting: a race torchrun has
    assert re.search(r"root cause: rank 1 \(node 1\) exit (1|-15): RuntimeError: rank 1 was told to fail",
                     st.stdout), st.stdout


def test_cancel_ends_the_job_and_its_workers(cluster, jobs):
    run, job_id = jobs["sleep"]
    wait_for(jobs["started"].exists, 120, "the sleeping worker to start")
    r = tandem(cluster, "cancel", str(run))
    assert r.returncode == 0 and r.stdout.strip() == f"cancelled: slurm job {job_id}", r.stdout + r.stderr
    st = wait_state(cluster, run, job_id, ["CANCELLED"])
    assert st.returncode == 1 and f"slurm job {job_id}: CANCELLED;" in st.stdout, st.stdout
    wait_for(lambda: not _running(str(jobs["script"])), 60, "the cancelled workers to exit")


def preempt(cluster, d) -> str:
    """A job in the high-priority partition that needs both nodes whole: Slurm preempts the low partition's
    jobs (SIGTERM to their tasks, GraceTime to save; each requeues itself), runs this one, then them again."""
    r = subprocess.run(["sbatch", "--parsable", "--partition=high", "--nodes=2", "--exclusive",
                        f"--output={d}/high-%j.out", "--wrap", "echo high"], env=cluster.env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture(scope="module")
def preemption(cluster, tmp_path_factory):
    """Two jobs in the low partition, both --max-requeues 1, preempted together once the training job's
    metrics show step 5: a `tandem train` job (2 nodes x 1 worker) that resumes and completes, and a sleeping
    one, preempted a second time once the first has completed (so no second preemption reaches it).
    Meanwhile, outside Slurm, the uninterrupted run of the same spec with the same world of 2."""
    from tandem.core.rundir import read_metrics

    d = tmp_path_factory.mktemp("preempt")
    spec = d / "job.toml"  # no periodic checkpoint: only the save on SIGTERM and the final one
    # One thread per worker on both sides: the same kernels' summation order (bitwise), and the two
    # "nodes" share this machine's cores (their default, all cores each, oversubscribes them 10x slower).
    spec.write_text(TINY.format(model="resnet18", remainder="drop", global_batch=16, micro_batch=8, max_steps=STEPS,
                                dtype="fp32", every=1000, keep=2, nproc=1, run_dir=d / "unused")
                    + "threads_per_worker = 1\n")
    sleeper = d / "sleeper_pre.py"  # a marker per start (both nodes' workers touch it)
    sleeper.write_text("import os, pathlib, sys, time\n"
                       "pathlib.Path(f\"{sys.argv[1]}.{os.environ.get('SLURM_RESTART_COUNT', '0')}\").touch()\n"
                       "time.sleep(600)\n")
    run, sleep_run, started = d / "run", d / "sleep", d / "started"
    low = ("--nodes", "2", "--partition", "low", "--max-requeues", "1")
    # rank 0 waits 150 ms per batch: the preemption (sbatch, scheduling, SIGTERM) lands well before the end
    train_id = submit(cluster, run, *low, str(spec), env={"TANDEM_FAULTS": "slow:rank=0:ms=150"})
    sleep_id = submit(cluster, sleep_run, *low, str(sleeper), str(started))
    uninterrupted = subprocess.Popen([sys.executable, "-m", "tandem", "train", "--json", str(spec),
                                      "--launch.nproc_per_node", "2", "--launch.run_dir", str(d / "ref")], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(d / "follow.out", "w") as out, open(d / "follow.err", "w") as err:  # from the queue to the end
        follow = subprocess.Popen([sys.executable, "-m", "tandem", "logs", str(run), "--follow"], cwd=ROOT,
                                  env={**cluster.env, "COLUMNS": "200"}, stdout=out, stderr=err)
    try:
        wait_for(lambda: (d / "started.0").exists() and any(r.get("kind") == "step" and r["step"] >= 5
                                                            for r in read_metrics(run)), 240,
                 "step 5 in the training job's metrics and the sleeping job's start")
        preempt(cluster, d)
        train = wait_state(cluster, run, train_id, ["COMPLETED", "FAILED", "CANCELLED"], timeout=300)
        wait_for((d / "started.1").exists, 150, "the sleeping job's second start")
        preempt(cluster, d)
        sleep = wait_state(cluster, sleep_run, sleep_id, ["FAILED", "COMPLETED", "CANCELLED"])
        out, err = uninterrupted.communicate(timeout=300)
        follow.wait(timeout=60)
    finally:
        uninterrupted.kill()
        follow.kill()
    assert uninterrupted.returncode == 0, err[-3000:]
    return {"train": (run, train_id, train), "sleep": (sleep_run, sleep_id, sleep), "reference": json.loads(out)}


STEPS = 24


def test_train_preempted_at_step_5_resumes_with_no_step_redone_and_ends_bitwise(cluster, preemption):
    """Preempted at step 5 or later: the workers save at the next agreed step and exit 143 (both nodes),
    the job requeues itself once, the next start resumes from that checkpoint (0 steps redone) and ends
    with weights bitwise equal to the uninterrupted run's."""
    from elastic.fault_helpers import assert_bitwise_equal, final_state
    from tandem.core.rundir import read_metrics

    run, job_id, st = preemption["train"]
    log = (run / "submit" / f"slurm-{job_id}.out").read_text()
    assert st.returncode == 0 and st.stdout.startswith(f"slurm job {job_id}: COMPLETED; nodes n[1-2]; requeued 1 "
                                                       "time(s)"), st.stdout + log[-3000:]
    assert log.count("requeueing job") == 1, log
    # both nodes saved and exited 143, though srun's --kill-on-bad-exit sends the second one SIGTERM again
    assert re.findall(r"task \d: Exited with exit code (\d+)", log) == ["143", "143"], log
    records = read_metrics(run, all_attempts=True)
    (stop,) = [r for r in records if r["kind"] == "stop"]
    starts = [r for r in records if r["kind"] == "start"]
    assert 5 <= stop["step"] < STEPS and [r["start_step"] for r in starts] == [0, stop["step"]], records
    # each start's rank logs, node 1's too (it names them after node 0's attempt, read once node 0 wrote it)
    assert sorted(p.name for p in (run / "logs").glob("rank-*.log") if ".err." not in p.name) == \
        ["rank-0.attempt2.log", "rank-0.log", "rank-1.attempt2.log", "rank-1.log"]
    # `tandem logs --follow`, started while the job was queued: both starts' lines, then it ended by itself
    followed = (run.parent / "follow.out").read_text()
    assert "[rank 0] step 5/24 " in followed and "[rank 0 attempt 2] resumed from " in followed, followed
    assert (run.parent / "follow.err").read_text().splitlines() == [
        f"slurm job {job_id}: sbatch output in {run}/submit/slurm-{job_id}.out",
        f"tandem logs: the job has ended (slurm job {job_id} COMPLETED)"]
    logs = tandem(cluster, "logs", str(run))
    assert logs.returncode == 0 and f"[rank 0] resumed from {run}/checkpoints/step-{stop['step']:08d}" in logs.stdout
    assert logs.stderr.strip() == f"slurm job {job_id}: sbatch output in {run}/submit/slurm-{job_id}.out"
    result, reference = json.loads((run / "result.json").read_text()), preemption["reference"]
    assert result["step"] == STEPS == reference["step"]
    assert_bitwise_equal(final_state(result["checkpoint"]), final_state(reference["checkpoint"]))


def test_preempted_twice_requeues_once_then_fails_with_the_reason(preemption):
    """The second preemption of a job with --max-requeues 1: requeued once, then failed, and `tandem
    status` says why in one line."""
    run, job_id, st = preemption["sleep"]
    assert st.returncode == 1 and st.stdout.startswith(f"slurm job {job_id}: FAILED;"), st.stdout
    assert "requeued 1 time(s)" in st.stdout and "exit 143:0" in st.stdout, st.stdout
    assert "stopped by SIGTERM (preemption, or --signal before the time limit) with 1 requeue(s) done, limit " \
           "--max-requeues 1" in st.stdout, st.stdout
    out = (run / "submit" / f"slurm-{job_id}.out").read_text()
    assert out.count("requeueing job") == 1 and "requeue limit 1 reached" in out, out


def _running(needle: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if needle in ln and not ln.lstrip().startswith("Z")]


def test_unknown_partition_is_refused_before_submitting(cluster, tmp_path):
    r = tandem(cluster, "submit", "--on", "slurm", "--partition", "gpu-big", "--run-dir", str(tmp_path / "r"),
               "examples/hello_dist.py")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("error: --partition: no such partition (got 'gpu-big'). Fix: use one of debug, high, low")
    assert not (tmp_path / "r" / "submit" / "job.json").exists()
