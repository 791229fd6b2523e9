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


def tandem(cluster, *args, timeout=120):
    return run_tandem(*args, env={k: cluster.env[k] for k in ("SLURM_CONF", "LD_LIBRARY_PATH", "PATH")},
                      timeout=timeout, cwd=ROOT)


def wait_state(cluster, run_dir, states, timeout=180):
    """Poll the controller (not a sleep) until the job reaches one of ``states``."""
    def done():
        r = tandem(cluster, "status", str(run_dir))
        return r if any(f": {s};" in r.stdout for s in states) else None
    return wait_for(done, timeout, f"the job in {run_dir} to reach {states}", interval=0.5)


def test_submit_two_nodes_runs_four_ranks(cluster, tmp_path):
    run = tmp_path / "hello"
    r = tandem(cluster, "submit", "--on", "slurm", "--nodes", "2", "--nproc-per-node", "2", "--run-dir", str(run),
               "examples/hello_dist.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("submitted: slurm job "), r.stdout
    st = wait_state(cluster, run, ["COMPLETED", "FAILED", "CANCELLED"])
    assert ": COMPLETED;" in st.stdout and "nodes n[1-2]" in st.stdout and "exit 0:0" in st.stdout, st.stdout
    assert st.returncode == 0
    out = next((run / "submit").glob("slurm-*.out")).read_text()
    ranks = sorted(ln for ln in out.splitlines() if "all_reduce sum" in ln)
    assert len(ranks) == 4 and all("sum 6 (expect 6)" in ln for ln in ranks), out
    assert {ln.split()[3] for ln in ranks} == {"0", "1"}  # "node K": both nodes' agents took part
    assert sorted(p.name for p in (run / "logs").glob("rank-?.log")) == [f"rank-{i}.log" for i in range(4)]


def test_failed_rank_is_named_and_not_requeued(cluster, tmp_path):
    run = tmp_path / "fail"
    env = {k: cluster.env[k] for k in ("SLURM_CONF", "LD_LIBRARY_PATH", "PATH")}
    r = run_tandem("submit", "--on", "slurm", "--nodes", "2", "--nproc-per-node", "2", "--max-requeues", "1",
                   "--run-dir", str(run), "examples/hello_dist.py", env={**env, "HELLO_FAIL_RANK": "3"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    st = wait_state(cluster, run, ["COMPLETED", "FAILED", "CANCELLED"])
    assert st.returncode == 1 and ": FAILED;" in st.stdout, st.stdout
    assert "requeued 0 time(s)" in st.stdout  # the other node's SIGTERM (exit 143) is not a preemption
    assert "root cause: rank 3 (node 1) exit 1: RuntimeError: rank 3 was told to fail" in st.stdout, st.stdout


def test_cancel_ends_the_job_and_its_workers(cluster, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import pathlib, sys, time\npathlib.Path(sys.argv[1]).touch()\ntime.sleep(600)\n")
    started, run = tmp_path / "started", tmp_path / "sleep"
    r = tandem(cluster, "submit", "--on", "slurm", "--nodes", "2", "--run-dir", str(run), str(script), str(started))
    assert r.returncode == 0, r.stderr
    wait_for(started.exists, 120, "the sleeping worker to start")
    r = tandem(cluster, "cancel", str(run))
    assert r.returncode == 0 and r.stdout.startswith("cancelled: slurm job "), r.stdout + r.stderr
    st = wait_state(cluster, run, ["CANCELLED"])
    assert st.returncode == 1
    wait_for(lambda: not _running(str(script)), 60, "the cancelled workers to exit")


def _running(needle: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if needle in ln and not ln.lstrip().startswith("Z")]


def test_unknown_partition_is_refused_before_submitting(cluster, tmp_path):
    r = tandem(cluster, "submit", "--on", "slurm", "--partition", "gpu-big", "--run-dir", str(tmp_path / "r"),
               "examples/hello_dist.py")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("error: --partition: no such partition (got 'gpu-big'). Fix: use one of debug")
    assert not (tmp_path / "r" / "submit" / "job.json").exists()
