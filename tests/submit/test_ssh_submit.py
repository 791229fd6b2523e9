"""`tandem submit --on ssh`: two network-namespace hosts, each running its own sshd (tests/ssh_hosts.py).

`tandem submit` runs inside the first host's namespace (a login node that is also node 0) and
reaches both hosts with OpenSSH and a generated key. Outside CI the host tests skip, with the
reason, without root, `ip netns` or an sshd (the system's or Debian's, fetched); in CI
(CI=true) they must run. The checks of bad input need neither.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from netns_hosts import netns_pair, why_not
from ssh_hosts import MARK, SshHosts, client_path, sshd_binary
from tandem_testing import ROOT, skip_here_fail_in_ci, tandem_in_process, wait_for

ADDR = ("10.231.9.1", "10.231.9.2")
IFNAME = "tdmnet"  # both ends of the veth pair: one GLOO_SOCKET_IFNAME (an allowlisted GLOO_*) fits both hosts
PROBE = str(ROOT / "tests" / "submit" / "ssh_probe.py")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = why_not()
    sshd = None
    if not why:
        sshd, why = sshd_binary()
    if why:
        skip_here_fail_in_ci(why, "the ssh tests")
    try:
        with netns_pair(f"tds{os.getpid() % 100000}", ADDR, IFNAME) as ns, \
                SshHosts(tmp_path_factory.mktemp("sshd"), sshd, ns) as h:
            yield h
    except RuntimeError as e:
        if "unavailable here" not in str(e) or os.environ.get("CI") == "true":
            raise
        pytest.skip(str(e))


def submit(h, tmp_path, slots, *args):
    """`tandem submit --on ssh` from the first host; the job's processes carry MARK=run_dir (a TANDEM_* variable)."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# test hosts\n{ADDR[0]} slots={slots[0]}\n\n{ADDR[1]} slots={slots[1]}  # second\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "COLUMNS": "200", "PATH": client_path(), "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": IFNAME,
           MARK: str(run_dir), "TANDEM_PROBE_ALLOWED": "yes", "PROBE_KEPT": "kept", "PROBE_OUTSIDE": "leaked"}
    proc = subprocess.Popen(["ip", "netns", "exec", h.hosts["ns"][0], sys.executable, "-m", "tandem", "submit", "--on",
                             "ssh", "--hostfile", str(hostfile), "--ssh-config", h.config, "--run-dir", str(run_dir),
                             "--env", "PROBE_KEPT", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, run_dir


def job_processes(h, run_dir) -> list[int]:
    return h.strays(f"{MARK}={run_dir}")


@pytest.mark.slow
def test_job_spans_both_hosts_with_uneven_slots_and_only_the_allowlisted_env(hosts, tmp_path):
    from tandem.submit.ssh_run import ssh_status

    proc, run_dir = submit(hosts, tmp_path, (1, 3), PROBE)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    lines = [ln for ln in out.splitlines() if " sum " in ln]
    assert len(lines) == 4, out
    expect = "env {'TANDEM_PROBE_ALLOWED': 'yes', 'PROBE_KEPT': 'kept', 'PROBE_OUTSIDE': None}"
    for rank in range(4):
        host, node, local = (ADDR[0], 0, "0/1") if rank == 0 else (ADDR[1], 1, f"{rank - 1}/3")
        assert any(ln.startswith(f"[{host}] ") and f"rank {rank}/4 node {node} local {local} sum 6 {expect}" in ln
                   for ln in lines), (rank, out)
    assert out.startswith(f"submitted: ssh job, world 4 on 2 host(s) ({ADDR[0]} x1, {ADDR[1]} x3)"), out
    state, line = ssh_status(run_dir)
    assert state == "DONE" and "world 4 on 2 host(s)" in line, line
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log") if ".err" not in p.name) == \
        [f"rank-{r}.log" for r in range(4)]
    assert not job_processes(hosts, run_dir)


@pytest.mark.slow
def test_killing_one_hosts_agent_fails_the_other_cleanly(hosts, tmp_path):
    from tandem.submit.record import read_record
    from tandem.submit.ssh_run import ssh_status

    watchdog_s = 20
    ready = tmp_path / "ready"
    ready.mkdir()
    proc, run_dir = submit(hosts, tmp_path, (1, 1), "--watchdog-s", str(watchdog_s), PROBE, str(ready))
    try:
        wait_for(lambda: len(list(ready.iterdir())) == 2, timeout=180, what="both ranks to all_reduce")
        wait_for(lambda: all(n["pid"] for n in read_record(run_dir)["nodes"]), timeout=30,
                 what="both agents' pids in submit/job.json")
        rec = read_record(run_dir)
        state, line = ssh_status(run_dir)
        assert state == "RUNNING" and f"agent pid {rec['nodes'][1]['pid']}" in line, line
        os.kill(rec["nodes"][1]["pid"], signal.SIGKILL)  # one pid namespace: the second host's agent
        t_kill = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    assert took < watchdog_s, (took, err[-2000:])
    assert f"tandem submit: failed: host {ADDR[1]} (node 1) exited with 255 first (its agent was killed" in err, \
        err[-2000:]
    state, line = ssh_status(run_dir)
    assert state == "FAILED" and f"host {ADDR[1]} (node 1)" in line, line
    assert read_record(run_dir)["nodes"][0]["rc"] not in (None, 0)
    wait_for(lambda: not job_processes(hosts, run_dir), timeout=30, what="no process of the job left on either host")


@pytest.mark.slow
def test_cancel_from_the_run_dir_stops_every_host(hosts, tmp_path):
    from tandem.submit.ssh_run import ssh_status

    ready = tmp_path / "ready"
    ready.mkdir()
    proc, run_dir = submit(hosts, tmp_path, (1, 1), PROBE, str(ready))
    try:
        wait_for(lambda: len(list(ready.iterdir())) == 2, timeout=180, what="both ranks to all_reduce")
        r = subprocess.run(["ip", "netns", "exec", hosts.hosts["ns"][0], sys.executable, "-m", "tandem", "cancel",
                            str(run_dir)], cwd=ROOT, env={**os.environ, "PATH": client_path(), "COLUMNS": "200"},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(f"cancelled: ssh job: SIGTERM to the agents on {ADDR[0]}, "
                                                         f"{ADDR[1]}"), r.stdout + r.stderr
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "tandem submit: cancelled: " in err and err.count("error: stopped by SIGTERM") == 2, err[-2000:]
    assert ssh_status(run_dir)[0] == "CANCELLED"
    wait_for(lambda: not job_processes(hosts, run_dir), timeout=30, what="no process of the job left on either host")


# -- bad input: one line each, before anything starts (no hosts needed) -------------------------------------


def _hostfile(tmp_path, text):
    p = tmp_path / "hosts"
    p.write_text(text)
    return str(p)


def test_dry_run_prints_one_ssh_command_per_host(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("NOT_PASSED", "x")
    hostfile = _hostfile(tmp_path, "a slots=2\nb slots=1\n")
    code, out, err = tandem_in_process(["submit", "--on", "ssh", "--hostfile", hostfile,
                                        "--env", "K=v w", "--run-dir", "/r", "--dry-run", "examples/hello_dist.py",
                                        "--n", "1"], capsys, monkeypatch)
    assert code in (0, None), err
    cmds = [ln for ln in out.splitlines() if ln.startswith("ssh ")]
    assert len(cmds) == 2 and "world 3" in out, out
    assert cmds[1].startswith("ssh -o BatchMode=yes b 'cd ")
    assert "NCCL_DEBUG=WARN" in cmds[0] and "NOT_PASSED" not in out and "K=***" in cmds[0] and "v w" not in out, cmds[0]   # --env values masked
    assert f"{sys.executable} -m tandem.cli.ssh_remote $PPID launch --cluster none --nproc-per-node 1 --nnodes 2 " \
           "--node-rank 1 --master-addr a --master-port 29500 --run-dir /r examples/hello_dist.py --n 1" in cmds[1]


@pytest.mark.parametrize("text,args,path,expect", [
    ("a slots=2\nb slot=4\n", ["examples/hello_dist.py"], None,
     "error: --hostfile {f} line 2: 'b slot=4' is not `HOST slots=N`. Fix: write it as `b slots=4`"),
    ("# hosts\na slots=two\n", ["examples/hello_dist.py"], None,
     "error: --hostfile {f} line 2: slots must be a whole number"),
    ("a slots=2\nb slots=1\n", ["--nproc-per-node", "2", "examples/hello_dist.py"], None,
     "error: --nproc-per-node: 4 ranks asked for, more than the slots: b has 1 (hostfile line 2), 2 wanted"),
    ("a slots=2\n", ["--nodes", "2", "examples/hello_dist.py"], None,
     "error: --nodes: 2 nodes asked for, but the hostfile lists 1 host(s)"),
    ("a slots=2\n", ["examples/hello_dist.py"], "", "error: --on: ssh is not on PATH"),
    ("a slots=2\nb slots=1\n", ["examples/digits_resnet.toml"], None,
     "error: --hostfile: a job spec needs the same number of workers on every node"),
])
def test_bad_input_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch, text, args, path, expect):
    f = _hostfile(tmp_path, text)
    code, out, err = tandem_in_process(["submit", "--on", "ssh", "--hostfile", f, "--run-dir", str(tmp_path / "r"),
                                        *args], capsys, monkeypatch,
                                       path=None if path is None else str(tmp_path))
    assert code == 2 and err.startswith(expect.format(f=f)) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_unreachable_host_is_one_line(tmp_path, capsys, monkeypatch):
    if not __import__("shutil").which("ssh"):
        pytest.skip("no ssh client here")
    with socket.socket() as s:  # a port nobody listens on: ssh is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  Port {port}\n  UserKnownHostsFile /dev/null\n")
    hostfile = _hostfile(tmp_path, "127.0.0.1 slots=1\n")
    code, out, err = tandem_in_process(["submit", "--on", "ssh", "--hostfile", hostfile,
                                        "--ssh-config", str(cfg), "--run-dir", str(tmp_path / "r"),
                                        "examples/hello_dist.py"], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: --hostfile: host 127.0.0.1 (line 1) cannot be reached over ssh: "), err
    assert "Connection refused" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()
