"""`tandem submit --on ray` on a real 2-node Ray cluster on this machine (ray.cluster_utils: a head and a
second node, 1 CPU each, so that the 2 workers land one per node).

One cluster for the module (Ray's start-up is the slow part on 2 shared cores), in a temp dir of its
own; every Ray process is stopped at teardown, on failure too. Outside CI the module skips, with the
reason, where Ray is not installed; in CI (CI=true, `make install` installs the ray extra) it must run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from elastic.fault_helpers import assert_bitwise_equal, final_state, processes_with, records
from tandem.submit.ray_driver import ray_status
from tandem_testing import ROOT, TINY, run_tandem, skip_here_fail_in_ci, wait_for

pytestmark = pytest.mark.slow

# 10 steps of 32 samples, checkpoints at 3, 6, 9 and 10: long enough to lose a node mid-run.
SPEC = dict(model="resnet18", remainder="drop", global_batch=32, micro_batch=8, max_steps=10, dtype="fp32",
            every=3, keep=4, nproc=2)


@pytest.fixture(scope="module")
def cluster():
    try:
        from ray.cluster_utils import Cluster
    except ImportError as e:
        skip_here_fail_in_ci(f"Ray is not installed ({e}): pip install 'tandem[ray]' (make install installs the ray "
                             "extra)", "the Ray tests")
    from ray._private.utils import get_ray_address_file

    temp = tempfile.mkdtemp(prefix="tr-", dir="/tmp")  # short: Ray's unix sockets live under it (107-byte limit)
    args = {"num_cpus": 1, "include_dashboard": False, "temp_dir": temp}
    # Cluster() records the head's address in Ray's default temp dir (/tmp/ray/ray_current_cluster) whatever
    # temp_dir says, and fails where nothing has created that folder yet (a fresh machine: no Ray has run)
    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    c = Cluster(initialize_head=True, connect=False, head_node_args=args)
    try:
        c.add_node(num_cpus=1, temp_dir=temp)
        c.node_args = {"num_cpus": 1, "temp_dir": temp}
        yield c
    finally:
        c.shutdown()
        left = processes_with(temp)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes left behind: {left}"


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("rayjob")
    p = d / "job.toml"
    # one thread a worker on both sides, whatever OMP_NUM_THREADS this process inherited
    p.write_text(TINY.format(**SPEC, run_dir=str(d / "unused")) + "threads_per_worker = 1\n")
    return p


def submit(cluster, spec, run_dir, *args, env=None):
    cmd = [sys.executable, "-m", "tandem", "submit", "--on", "ray", "--address", cluster.address, "--workers", "2",
           "--run-dir", str(run_dir), *args, str(spec)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "200", **(env or {})})


def losses(run_dir):
    return {r["step"]: r["loss"] for r in records(run_dir, "step")}


@pytest.fixture(scope="module")
def runs(cluster, spec, tmp_path_factory):
    """`tandem train` with 2 ranks and the same spec on Ray, side by side (Ray's start-up waits mostly)."""
    d = tmp_path_factory.mktemp("runs")
    ref = subprocess.Popen([sys.executable, "-m", "tandem", "train", "--json", str(spec), "--launch.run_dir",
                            str(d / "ref")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "COLUMNS": "200"})
    ray = submit(cluster, spec, d / "ray")
    try:
        out, err = ray.communicate(timeout=600)
        rout, rerr = ref.communicate(timeout=600)
    finally:
        for p in (ray, ref):
            if p.poll() is None:
                p.kill()
    assert ray.returncode == 0, err[-3000:] + out[-2000:]
    assert ref.returncode == 0, rerr[-3000:]
    return {"ref": d / "ref", "ray": d / "ray", "out": out, "result": json.loads(rout)}


def test_two_workers_match_tandem_train(runs):
    assert "submitted: ray job, 2 worker(s) on " in runs["out"], runs["out"]
    assert "done: 10 steps on 2 Ray workers" in runs["out"] and "0 restart(s)" in runs["out"], runs["out"]
    ref, ray = runs["ref"], runs["ray"]
    assert losses(ray) == losses(ref) and sorted(losses(ref)) == list(range(1, 11))
    # the same ranks, batches, seeds and threads (1 per worker: Ray's OMP_NUM_THREADS, tandem's 2 cores / 2):
    # gloo sums in the same order, so the weights and the optimizer state are bitwise equal
    assert_bitwise_equal(final_state(ref / "checkpoints" / "step-00000010"),
                         final_state(ray / "checkpoints" / "step-00000010"))
    assert sorted(p.name for p in (ray / "logs").glob("rank-*.log")) == [
        "rank-0.err.log", "rank-0.log", "rank-1.err.log", "rank-1.log"]
    start = records(ray, "start")[0]
    assert start["world"] == 2 and start["backend"] == "gloo"
    st = run_tandem("status", str(ray))
    assert st.returncode == 0 and ": COMPLETED; 2 worker(s) on " in st.stdout and "step 10/10" in st.stdout, st


def test_more_workers_than_cpus_is_one_line(cluster, spec, tmp_path):
    p = submit(cluster, spec, tmp_path / "run", "--workers", "4")  # the last --workers wins
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and err.count("\n") == 1, err
    assert "error: --workers: 4 workers need 4 CPUs, the cluster has 2" in err, err
    assert not (tmp_path / "run").exists()


def test_node_lost_resumes_from_tandem_checkpoint(cluster, spec, runs, tmp_path):
    """Both ranks stop after step 7 (first attempt only), checkpoint 6 is on disk; the second node goes
    away (its worker dies with it) and a fresh node joins: Ray restarts the group, which resumes from 6."""
    run = tmp_path / "run"
    p = submit(cluster, spec, run, "--max-failures", "1",
               env={"TANDEM_FAULTS": "hang:rank=0:step=7,hang:rank=1:step=7"})
    try:
        wait_for(lambda: any(r["step"] >= 6 for r in records(run, "ckpt")), 300, "checkpoint 6 in metrics.jsonl",
                 interval=0.2)
        state, line = ray_status(run)
        assert state == "RUNNING" and "restarted 0 time(s) (limit --max-failures 1)" in line, line
        cluster.remove_node(cluster.list_all_nodes()[-1])
        cluster.add_node(**cluster.node_args)  # the replacement: two workers need two nodes of 1 CPU
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:] + out[-2000:]
    result = json.loads((run / "result.json").read_text())
    (r,) = result["restarts"]
    assert r["resumed_step"] == 6 and r["steps_redone"] <= 1, r
    assert "1 restart(s)" in out, out
    assert_bitwise_equal(final_state(runs["ref"] / "checkpoints" / "step-00000010"),
                         final_state(run / "checkpoints" / "step-00000010"))
    assert (run / "logs" / "rank-0.restart1.log").is_file()
    print(f"node lost after step {r['last_step_before']}: resumed at {r['resumed_step']}, "
          f"{r['steps_redone']} step(s) redone, {r['lost_s']} s lost")
