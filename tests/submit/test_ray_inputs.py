"""`tandem submit --on ray`: bad input is one line before anything starts or is written, and a Ray Train
worker's environment is read as one (no Ray cluster here: test_ray_submit.py runs the real one)."""

from __future__ import annotations

import importlib.util
import socket

from tandem.core.environment import ClusterEnv
from tandem_testing import tandem_in_process


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_unreachable_address_is_one_line(tiny_spec, tmp_path, capsys, monkeypatch):
    run = tmp_path / "r"
    code, out, err = tandem_in_process(["submit", "--on", "ray", "--address", f"127.0.0.1:{_closed_port()}",
                                        "--run-dir", str(run), str(tiny_spec())], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --address: no Ray head answers there") and "ray start --head" in err, err
    assert not run.exists()


def test_ray_not_installed_names_the_extra(tiny_spec, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("ray") else
                        real(name, *a))
    code, out, err = tandem_in_process(["submit", "--on", "ray", "--run-dir", str(tmp_path / "r"), str(tiny_spec())],
                                       capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1, err
    assert "error: --on: Ray Train is not installed (got 'ray'). Fix: pip install 'tandem[ray]'" in err, err


def test_a_script_is_refused(tmp_path, capsys, monkeypatch):
    code, out, err = tandem_in_process(["submit", "--on", "ray", "examples/hello_dist.py"], capsys, monkeypatch)
    assert code == 2 and "Ray runs a job spec" in err and err.count("\n") == 1, err


def test_ray_train_worker_env_is_read():
    ray = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RAY_RAYLET_PID": "42"}
    env = ClusterEnv.detect(ray)
    assert (env.source, env.rank, env.world, env.local_rank, env.local_world, env.node, env.distributed) == (
        "ray", 3, 4, 1, 2, 1, True)
    # torchrun inside a Ray task keeps torchrun's reading (GROUP_RANK is torchrun's node)
    assert ClusterEnv.detect({**ray, "GROUP_RANK": "0"}).source == "torchrun"


def test_status_of_a_ray_job_from_the_run_dir(tmp_path, capsys, monkeypatch):
    """What the driver leaves in RUN_DIR/submit/job.json, read back: a failure's reason, and a driver that
    is gone while its record still says RUNNING."""
    import json
    import subprocess
    import sys

    from tandem.submit.record import update_record

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    update_record(tmp_path, engine="ray", state="FAILED", run_id="abc", workers=2, address="local", device="cpu",
                 backend="gloo", max_failures=1, reason="rank 1: RuntimeError: told to fail")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "start", "total_steps": 10, "start_step": 0}) + "\n"
                                            + json.dumps({"kind": "step", "step": 4}) + "\n"
                                            + json.dumps({"kind": "restart", "resumed_step": 3}) + "\n")
    code, out, err = tandem_in_process(["status", str(tmp_path)], capsys, monkeypatch)
    assert code == 1 and out == ("ray job abc: FAILED; 2 worker(s) on local (cpu/gloo); step 4/10; restarted 1 "
                                 "time(s) (limit --max-failures 1); rank 1: RuntimeError: told to fail\n"), out
    update_record(tmp_path, state="RUNNING", driver_pid=int(gone), driver_host=socket.gethostname())
    code, out, err = tandem_in_process(["status", str(tmp_path)], capsys, monkeypatch)
    assert code == 1 and "FAILED;" in out and f"the driver (pid {gone}) is gone" in out, out


def test_the_failure_line_names_the_rank_that_failed_not_its_peers():
    import pytest

    exceptions = pytest.importorskip("ray.train.v2.api.exceptions")
    from tandem.submit.ray_driver import _one_line

    peer = RuntimeError("Traceback ...\nRuntimeError: [/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:9894. "
                        "This is typically caused by a remote worker crashing.")
    died = RuntimeError("Traceback ...\n  File \"trainer.py\"\nValueError: loss is nan at step 4")
    e = exceptions.WorkerGroupError("snippets", {0: peer, 1: died})
    assert _one_line(e) == "rank 1: ValueError: loss is nan at step 4"
