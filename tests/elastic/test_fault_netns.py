"""Two hosts with their own addresses: network namespaces joined by a veth pair; cut the link.

Needs root and `ip netns` (skipped with the reason otherwise). The namespaces and the
veth pair are created by the fixture and removed after the test, whatever happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from elastic.fault_helpers import wait_for, write_spec
from netns_hosts import ip, netns_pair, why_not
from tandem_testing import ROOT


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return ip(*args, check=check)


@pytest.fixture
def two_hosts():
    if why_not():
        pytest.skip(why_not())
    try:
        with netns_pair(f"tdm{os.getpid() % 100000}") as hosts:
            yield hosts
    except RuntimeError as e:
        if "unavailable here" not in str(e):
            raise
        pytest.skip(str(e))


def _on_host(host: dict, i: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    full = {**os.environ, "COLUMNS": "200", "GLOO_SOCKET_IFNAME": host["veth"][i], **(env or {})}
    return subprocess.Popen(["ip", "netns", "exec", host["ns"][i], sys.executable, "-m", "tandem", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT)


@pytest.mark.slow
def test_two_namespace_hosts_train_then_cut_link_is_caught(two_hosts, tmp_path):
    h, port = two_hosts, "29531"
    # 1. the link works: a collective between the two hosts
    procs = [_on_host(h, i, "launch", "--nnodes", "2", "--node-rank", str(i), "--master-addr", h["addr"][0],
                      "--master-port", port, "--timeout", "60", "--run-dir", str(tmp_path / f"hello{i}"),
                      "--quiet", str(ROOT / "examples" / "hello_dist.py")) for i in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "all_reduce sum 1 (expect 1)" in (tmp_path / "hello1" / "logs" / "rank-1.log").read_text()

    # 2. training across the hosts, then the link is cut: both watchdogs catch the hang
    T = 10  # generous: a busy 2-core VM runs other suites beside this one
    runs = [tmp_path / f"host{i}" for i in range(2)]
    procs = []
    for i in range(2):
        spec = write_spec(tmp_path / f"job{i}.toml", runs[i], nproc=1, max_steps=400, every=0)
        procs.append(_on_host(h, i, "train", "--json", str(spec), "--launch.nnodes", "2", "--launch.node_rank", str(i),
                              "--launch.master_addr", h["addr"][0], "--launch.master_port", str(int(port) + 1),
                              "--launch.watchdog_s", str(T), "--launch.threads_per_worker", "1",
                              "--checkpoint.at_end", "false"))
    wait_for(lambda: any(r["kind"] == "step" and r["step"] >= 3 for r in _metrics(runs[0])), timeout=180,
             what="training across the two hosts to make progress")
    _ip("-n", h["ns"][0], "link", "set", h["veth"][0], "down")
    t_cut = time.time()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    for i in range(2):
        hang = json.loads(next((runs[i] / "watchdog").glob("hang-*.json")).read_text())
        assert hang["detected_at"] - t_cut < T + 5, hang
        assert "watchdog" in outs[i][1] and "no progress" in outs[i][1]


def _metrics(run_dir):
    from tandem.train import metrics

    return metrics.read(run_dir)
