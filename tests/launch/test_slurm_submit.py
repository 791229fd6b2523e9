"""`tandem submit --on slurm` on a real 2-node Slurm cluster (Debian's slurmctld/slurmd/munged on loopback).

The cluster comes up once for this module (tests/slurm_cluster.py, about 1-4 s) and every
daemon, slurmstepd and job task is killed at teardown. Outside CI the tests skip, with the
reason, where Slurm's packages cannot be fetched; in CI (CI=true) they must run.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from slurm_cluster import SlurmCluster, slurm_root
from tandem_testing import ROOT, run_tandem, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root, why = slurm_root()
    if root is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests: {why}")
        pytest.skip(why)
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
    """The module's three jobs, submitted at once (they run side by side: 4 CPUs per node, 1 per job)."""
    d = tmp_path_factory.mktemp("jobs")
    script = d / "sleeper.py"
    script.write_text("import pathlib, sys, time\npathlib.Path(sys.argv[1]).touch()\ntime.sleep(600)\n")
    other = d / "sleeper_rq.py"  # its own name: the cancel test looks for leftover sleeper.py processes
    other.write_text(script.read_text())
    return {"hello": (d / "hello", submit(cluster, d / "hello", "--nodes", "2", "--nproc-per-node", "2",
                                          "examples/hello_dist.py")),
            "fail": (d / "fail", submit(cluster, d / "fail", "--nodes", "2", "--max-requeues", "1",
                                        "examples/hello_dist.py", env={"HELLO_FAIL_RANK": "1"})),
            "sleep": (d / "sleep", submit(cluster, d / "sleep", "--nodes", "2", str(script), str(d / "started"))),
            "requeue": (d / "requeue", submit(cluster, d / "requeue", "--max-requeues", "1", str(other),
                                              str(d / "started-requeue"))),
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
    assert "root cause: rank 1 (node 1) exit 1: RuntimeError: rank 1 was told to fail" in st.stdout, st.stdout


def test_cancel_ends_the_job_and_its_workers(cluster, jobs):
    run, job_id = jobs["sleep"]
    wait_for(jobs["started"].exists, 120, "the sleeping worker to start")
    r = tandem(cluster, "cancel", str(run))
    assert r.returncode == 0 and r.stdout.strip() == f"cancelled: slurm job {job_id}", r.stdout + r.stderr
    st = wait_state(cluster, run, job_id, ["CANCELLED"])
    assert st.returncode == 1 and f"slurm job {job_id}: CANCELLED;" in st.stdout, st.stdout
    wait_for(lambda: not _running(str(jobs["script"])), 60, "the cancelled workers to exit")


def test_sigterm_requeues_up_to_the_limit(cluster, jobs):
    """SIGTERM to the job's steps (what preemption and --signal send): saved-and-exited 143, requeued once,
    started again; the second SIGTERM finds the limit reached and the job fails with that reason."""
    run, job_id = jobs["requeue"]
    marker = jobs["started"].parent / "started-requeue"

    def restarts():
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster.env, capture_output=True,
                             text=True).stdout
        return out.split("Restarts=", 1)[1].split()[0] if "Restarts=" in out else None

    for expect in ("0", "1"):
        wait_for(lambda: marker.exists() and restarts() == expect, 150, f"start {expect} of job {job_id}")
        marker.unlink()
        r = subprocess.run(["scancel", "--signal=TERM", job_id], env=cluster.env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    st = wait_state(cluster, run, job_id, ["FAILED", "COMPLETED", "CANCELLED"])
    assert st.returncode == 1 and st.stdout.startswith(f"slurm job {job_id}: FAILED;"), st.stdout
    assert "requeued 1 time(s)" in st.stdout and "exit 143:0" in st.stdout, st.stdout
    assert "stopped by SIGTERM (preemption, or --signal before the time limit) with 1 requeue(s) done, limit " \
           "--max-requeues 1" in st.stdout, st.stdout
    out = (run / "submit" / f"slurm-{job_id}.out").read_text()
    assert "requeueing job" in out and "requeue limit 1 reached" in out, out


def _running(needle: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if needle in ln and not ln.lstrip().startswith("Z")]


def test_unknown_partition_is_refused_before_submitting(cluster, tmp_path):
    r = tandem(cluster, "submit", "--on", "slurm", "--partition", "gpu-big", "--run-dir", str(tmp_path / "r"),
               "examples/hello_dist.py")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("error: --partition: no such partition (got 'gpu-big'). Fix: use one of debug")
    assert not (tmp_path / "r" / "submit" / "job.json").exists()
