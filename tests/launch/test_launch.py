"""The launcher for real: torchrun agents, simulated nodes, failures, ports and timeouts."""

import socket
import time

import pytest

from tandem_testing import ROOT, run_tandem

HELLO = str(ROOT / "examples" / "hello_dist.py")


@pytest.mark.slow
def test_simulated_nodes_give_real_node_ranks(tmp_path):
    r = run_tandem("launch", "--nproc-per-node", "2", "--simulate-nodes", "2", "--run-dir", str(tmp_path), HELLO)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    for rank in range(4):  # rank-prefixed console stream
        assert f"[rank{rank}]:rank {rank}/4" in out
    # one log file per rank, named by global rank; node and local rank as torchrun assigned them
    logs = {rank: (tmp_path / "logs" / f"rank-{rank}.log").read_text() for rank in range(4)}
    nodes = {rank: int(text.split(" node ")[1].split()[0]) for rank, text in logs.items()}
    locals_ = {rank: int(text.split("local_rank ")[1].split()[0]) for rank, text in logs.items()}
    assert sorted(nodes.values()) == [0, 0, 1, 1]
    assert all(nodes[r] == r // 2 and locals_[r] == r % 2 for r in range(4))
    assert all("all_reduce sum 6 (expect 6)" in t for t in logs.values())


@pytest.mark.slow
def test_failure_summary_names_root_cause(tmp_path):
    r = run_tandem("launch", "--nproc-per-node", "2", "--simulate-nodes", "2", "--run-dir", str(tmp_path),
                   "--quiet", HELLO, env={"HELLO_FAIL_RANK": "2"})
    assert r.returncode == 1
    err = " ".join(r.stderr.split())
    assert "rank 2 (node 1, local rank 0" in err and "failed first" in err
    assert "rank 2 was told to fail" in err and "Traceback" in r.stderr
    assert (tmp_path / "errors" / "rank-2.json").is_file()


def test_native_crash_is_named_by_signal_and_fatal_error(tmp_path):
    """A rank killed by a signal has no error file: the summary names the signal and quotes
    faulthandler's report (its header and the crashing stack, not the list of loaded modules)."""
    script = tmp_path / "crash.py"
    script.write_text("import ctypes, faulthandler, os\nfaulthandler.enable()\n\n\n"
                      "def crash_here():\n    ctypes.string_at(0)\n\n\n"
                      "if os.environ['RANK'] == '1':\n    crash_here()\n")
    r = run_tandem("launch", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--quiet", str(script))
    assert r.returncode == 1
    err = " ".join(r.stderr.split())
    assert "rank 1 (node 0, local rank 1" in err
    assert "failed first with signal 11 (SIGSEGV): Fatal Python error: Segmentation fault" in err
    assert "crash_here" in r.stderr and "Extension modules" not in r.stderr


def test_single_node_user_script_with_args(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import os, sys\nprint('args', sys.argv[1:], os.environ['TANDEM_BACKEND'], "
                      "os.environ['WORLD_SIZE'])\n")
    r = run_tandem("launch", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), str(script), "--lr", "3")
    assert r.returncode == 0, r.stderr
    assert "args ['--lr', '3'] gloo 2" in (tmp_path / "run" / "logs" / "rank-1.log").read_text()


def test_master_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_tandem("launch", "--nnodes", "2", "--node-rank", "0", "--master-port", str(port),
                       "--run-dir", str(tmp_path), HELLO)
    assert r.returncode == 2
    assert f"launch.master_port: master port {port} on 127.0.0.1 is in use" in " ".join(r.stderr.split())


@pytest.mark.slow
@pytest.mark.parametrize("how", ["static", "c10d", "static-verbose"])
def test_unreachable_master_fails_within_timeout_in_one_line(tmp_path, how):
    """torch's C++ TCPStore logs each retry with stack frames (30-80 lines): only --verbose shows them."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = (["--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)] if how != "c10d"
             else ["--rdzv-endpoint", f"127.0.0.1:{port}"])
    t0 = time.monotonic()
    r = run_tandem("launch", "--nnodes", "2", *where, "--timeout", "3", "--run-dir", str(tmp_path),
                   *(["--verbose"] if how.endswith("verbose") else []), HELLO, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert lines[-1].startswith("error: launch.") and "could not join the rendezvous" in lines[-1], r.stderr
    if how.endswith("verbose"):
        assert any("TCPStore" in line for line in lines[:-1]), r.stderr  # torch's own logs, as asked
    else:
        assert len(lines) == 1, r.stderr
    assert elapsed < 60


def test_missing_script(tmp_path):
    r = run_tandem("launch", "--run-dir", str(tmp_path), str(tmp_path / "nope.py"))
    assert r.returncode == 2 and "script: script not found" in r.stderr


@pytest.mark.slow
def test_train_unreachable_master_is_one_line(tmp_path, tiny_spec):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_tandem("train", str(tiny_spec()), "--launch.nnodes", "2", "--launch.node_rank", "1",
                   "--launch.master_port", str(port), "--launch.timeout_s", "3", timeout=120)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: launch.master_addr: could not join the rendezvous at 127.0.0.1:"), line
