"""Slurm's env and node lists read as Slurm itself reads them; the sbatch script tandem writes.

No cluster here: the node-list table is also checked against the real `scontrol show
hostnames` when Slurm's packages can be fetched (tests/slurm_cluster.py).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tandem.core.errors import LaunchError
from tandem.launch.cluster_env import from_cluster
from tandem.core.spec import LaunchSpec as LaunchArgs
from tandem.launch.slurm_env import default_port, expand_hostlist, node_address, slurm_env, slurm_rendezvous
from tandem_testing import skip_here_fail_in_ci, tandem_in_process

# pattern -> what scontrol show hostnames prints (Slurm 22.05.8, Debian 12), one name per line
HOSTLISTS = {
    "n[1-2]": ["n1", "n2"],
    "gpu-[001-003,010]": ["gpu-001", "gpu-002", "gpu-003", "gpu-010"],
    "a,b,c": ["a", "b", "c"],
    "linux[1,2]": ["linux1", "linux2"],  # Lightning's users saw this parsed as "linux[1"
    "r[1-2]n[1-2]": ["r1n1", "r1n2", "r2n1", "r2n2"],
    "n[9-11]": ["n9", "n10", "n11"],
    "n[09-11]": ["n09", "n10", "n11"],
    "n[001-2]": ["n001", "n002"],
    "n[08-10]": ["n08", "n09", "n10"],
    "n1,n1": ["n1", "n1"],
    "n[1-2],m[3]": ["n1", "n2", "m3"],
    "c1-[1-2]": ["c1-1", "c1-2"],
    "10.0.0.[1-2]": ["10.0.0.1", "10.0.0.2"],
    "n[1-2]-[3-4]": ["n1-3", "n1-4", "n2-3", "n2-4"],
    "n[2,1]": ["n2", "n1"],
    "node": ["node"],
    "n[1-3,2]": ["n1", "n2", "n3", "n2"],
    "a[1-2],b": ["a1", "a2", "b"],
    "x-[1-2]-y-[3-4]": ["x-1-y-3", "x-1-y-4", "x-2-y-3", "x-2-y-4"],
    "n[1]": ["n1"],
    "a b": ["a", "b"],
}
# scontrol 22.05 answers "Invalid hostlist" (or an invalid range) for these: an error, not a guess
INVALID = ["x[1,3]-ib", "x[1-2]y", "n[3-1]", "n[1-2]x,n5", "n[a-b]", "n[1-2"]


@pytest.mark.parametrize("pattern", list(HOSTLISTS))
def test_hostlist_expands_as_scontrol_does(pattern):
    assert expand_hostlist(pattern) == HOSTLISTS[pattern]


@pytest.mark.parametrize("pattern", INVALID)
def test_hostlist_that_scontrol_refuses_is_an_error(pattern):
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST: invalid Slurm node list"):
        expand_hostlist(pattern)


def test_table_matches_the_real_scontrol(tmp_path):
    """The table above is what scontrol prints: asked again here, when Slurm can be fetched."""
    from slurm_cluster import LIB, slurm_root

    root, why = slurm_root()
    if root is None:
        skip_here_fail_in_ci(why, "the Slurm tests")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=x\nSlurmctldHost=localhost\nPluginDir={root / LIB / 'slurm-wlm'}\n")
    env = {**os.environ, "SLURM_CONF": str(conf),
           "LD_LIBRARY_PATH": f"{root / LIB}:{root / LIB / 'slurm-wlm'}"}
    for pattern, hosts in HOSTLISTS.items():
        r = subprocess.run([str(root / "usr/bin/scontrol"), "show", "hostnames", pattern], env=env,
                           capture_output=True, text=True, timeout=30)
        assert r.stdout.split() == hosts, pattern
    for pattern in INVALID[:4]:  # scontrol's own odd answers for unclosed brackets are not worth copying
        r = subprocess.run([str(root / "usr/bin/scontrol"), "show", "hostnames", pattern], env=env,
                           capture_output=True, text=True, timeout=30)
        assert "Invalid" in r.stdout + r.stderr, pattern


STEP = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_RESTART_COUNT": "1"}


def test_slurm_env_reads_a_step():
    s = slurm_env(STEP)
    assert (s.job_id, s.nodelist, s.nnodes, s.node_rank, s.in_step, s.ntasks, s.restart_count) == \
        ("4242", ["gpu-07", "gpu-08"], 2, 1, True, 2, 1)
    assert slurm_env({}) is None


def test_rendezvous_on_the_first_node():
    seen = []

    def addr(host):
        seen.append(host)
        return "10.1.2.7"

    r = slurm_rendezvous(STEP, address=addr)
    assert (r.nnodes, r.node_rank, r.master_addr, r.master_port) == (2, 1, "10.1.2.7", default_port("4242"))
    assert seen == ["gpu-07"]
    r = slurm_rendezvous({**STEP, "MASTER_ADDR": "h0", "MASTER_PORT": "31000"}, address=addr)
    assert (r.master_addr, r.master_port) == ("h0", 31000)


def test_no_rendezvous_outside_a_one_task_per_node_step():
    batch = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}  # the batch script, an salloc shell
    assert slurm_rendezvous(batch) is None
    assert slurm_rendezvous({**STEP, "SLURM_STEP_NUM_TASKS": "4"}) is None  # srun -n 4: a task per worker


def test_node_address_falls_back_to_scontrol_nodeaddr(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho NodeName=$3 Arch=x86_64 NodeAddr=192.0.2.5 NodeHostName=$3\n")
    fake.chmod(0o755)

    def no_dns(host):
        raise OSError("no such host")

    assert node_address("n1", resolve=no_dns, scontrol=str(fake)) == "192.0.2.5"
    with pytest.raises(LaunchError, match="does not resolve"):
        node_address("n1", resolve=no_dns, scontrol=str(tmp_path / "absent"))


def test_launch_takes_slurm_env_unless_flags_say_otherwise():
    env = {**STEP, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "31001"}
    got = from_cluster(LaunchArgs(nproc_per_node=2), env)
    assert (got.nnodes, got.node_rank, got.master_addr, got.master_port) == ("2", 1, "10.0.0.1", 31001)
    mine = LaunchArgs(nnodes="3", node_rank=2, master_addr="h", master_port=1234)
    assert from_cluster(mine, env) == mine
    assert from_cluster(LaunchArgs(), {}) == LaunchArgs()
    one = {**STEP, "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
           "SLURM_STEP_NUM_TASKS": "1"}  # e.g. `srun pytest`: keep the standalone rendezvous on a free port
    assert from_cluster(LaunchArgs(nproc_per_node=2), one) == LaunchArgs(nproc_per_node=2)


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path, capsys, monkeypatch):
    code, out, err = tandem_in_process(
        ["submit", "--on", "slurm", "--nodes", "2", "--nproc-per-node", "2", "--time", "10", "--max-requeues", "1",
         "--signal-s", "30", "--partition", "low", "--run-dir", str(tmp_path / "r"), "--dry-run",
         "examples/hello_dist.py", "--steps", "3"], capsys, monkeypatch)
    assert code == 0, err
    lines = out.splitlines()
    for d in ("--nodes=2", "--ntasks-per-node=1", "--time=10", "--requeue", "--signal=TERM@30", "--partition=low"):
        assert f"#SBATCH {d}" in lines
    step = next(ln for ln in lines if ln.startswith("srun "))
    assert "--kill-on-bad-exit=1" in step and step.endswith("--nproc-per-node 2 --run-dir "
                                                            f"{tmp_path / 'r'} examples/hello_dist.py --steps 3")
    assert any('-lt 1 ]' in ln and "143" in ln for ln in lines)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("extra,msg", [
    (["--time", "soon"], "error: --time: not a Slurm time (got 'soon'). Fix: use minutes"),
    (["--nodes", "0"], "error: --nodes: must be at least 1 (got 0)."),
    (["--on", "pbs"], "error: --on: 'pbs' is not one of slurm, k8s, ssh, ray. Fix: use --on slurm, --on k8s, --on ssh or --on ray"),
    (["--max-requeues", "-1"], "error: --max-requeues: must not be negative (got -1)."),
])
def test_submit_bad_input_is_one_line_before_anything(extra, msg, tmp_path, capsys, monkeypatch):
    code, out, err = tandem_in_process(["submit", "--on", "slurm", "--run-dir", str(tmp_path / "r"), *extra,
                                        "examples/hello_dist.py"], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(msg), err
    assert not (tmp_path / "r").exists()


def test_submit_missing_script_or_sbatch(tmp_path, capsys, monkeypatch):
    code, _, err = tandem_in_process(["submit", "--on", "slurm", "nope.py"], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: script: file not found (got 'nope.py')"), err
    code, _, err = tandem_in_process(["submit", "--on", "slurm", "--run-dir", str(tmp_path / "r"),
                                      "examples/hello_dist.py"], capsys, monkeypatch, path=str(tmp_path))
    assert code == 2 and err.startswith("error: --on: sbatch is not on PATH"), err
    assert not (tmp_path / "r").exists()
    code, _, err = tandem_in_process(["status", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: run_dir: no submitted job here"), err


def test_job_spec_runs_under_tandem_train_with_the_node_rank_per_node(tmp_path, capsys, monkeypatch):
    """The path run by hand on the test cluster (docs/clusters.md: preempted, requeued, bitwise equal)."""
    code, out, err = tandem_in_process(["submit", "--on", "slurm", "--nodes", "2", "--run-dir", str(tmp_path / "r"),
                                        "--dry-run", "examples/gpt_reverse.toml", "--schedule.max_steps", "5"],
                                       capsys, monkeypatch)
    assert code == 0, err
    step = next(ln for ln in out.splitlines() if ln.startswith("srun "))
    assert "bash -c 'exec \"$@\" --launch.node_rank \"$SLURM_NODEID\" --launch.master_addr \"$MASTER_ADDR\" " \
           "--launch.master_port \"$MASTER_PORT\"' tandem " in step, step
    assert " -m tandem train examples/gpt_reverse.toml --schedule.max_steps 5 --launch.nproc_per_node 1 " \
           "--launch.nnodes 2 --launch.simulate_nodes 0 " in step, step
