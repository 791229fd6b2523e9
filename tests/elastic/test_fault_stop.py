"""SIGTERM (a join, a preemption, a drained node): the group agrees on a step, checkpoints
there and exits; the restart resumes from that step and redoes none. SIGTERM to one rank
inside a restarting run: test_fault_restart.py; torchrun's SIGTERM for a join: test_fault_join.py."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tandem.train.elastic.stop import EXIT_CODE
from elastic.fault_helpers import (assert_bitwise_equal, final_state, finish, heartbeat, records, start_train,
                                   processes_with, wait_for, write_spec)
from tandem_testing import ROOT

pytestmark = [pytest.mark.slow]


def _stop_child(body: str, grace: float = 1.0) -> subprocess.Popen:
    code = ("import os, signal, threading, time\n"
            "from tandem.train.elastic.stop import StopRequest\n"
            f"stop = StopRequest(True, grace_s={grace})\n"
            "print('ready', flush=True)\n" + body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def test_a_rank_that_cannot_reach_an_agreed_step_exits_after_the_grace():
    """A peer gone or stuck: the rank waits inside a collective, in C++, where Python runs no
    signal handler. It must not hold torchrun's restart for its 30 s: it exits with code 143
    after term_grace_s without progress."""
    child = _stop_child("import torch\ntorch.futures.Future().wait()\n")  # blocked, as in work.wait()
    assert child.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    assert child.returncode == EXIT_CODE == 143
    assert 0.5 <= time.monotonic() - t0 < 10
    assert "no progress for 1 s and no step agreed with the other ranks" in err


def test_a_forked_child_keeps_the_default_sigterm():
    """A DataLoader worker forked from a rank is not a rank: SIGTERM ends it at once."""
    child = _stop_child("r, w = os.pipe()\n"
                        "pid = os.fork()\n"
                        "if pid == 0:\n    os.write(w, b'up')\n    time.sleep(60)\n    os._exit(0)\n"
                        "os.read(r, 2)\n"  # the child runs Python: past fork's own signal handling
                        "os.kill(pid, signal.SIGTERM)\n"
                        "_, status = os.waitpid(pid, 0)\n"
                        "print('child', os.WTERMSIG(status) if os.WIFSIGNALED(status) else 'exited', flush=True)\n")
    assert child.stdout.readline() == "ready\n"
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    assert out == f"child {int(signal.SIGTERM)}\n"


def test_an_agreed_stop_disarms_the_grace_timer():
    child = _stop_child("while not stop.flag:\n    time.sleep(0.01)\n"
                        "assert stop.agreed(stop.flag)\n"
                        "time.sleep(2)\n"  # a long save: the timer must not end it
                        "print('saved', flush=True)\n", grace=0.5)
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    assert out == "saved\n"


def test_sigterm_to_the_job_stops_it_with_a_checkpoint_and_the_rerun_ends_bitwise(reference, tmp_path):
    """A scheduler preempting the job signals `tandem train` itself (here with 2 simulated
    nodes, whose agents it forwards the signal to): exit 143 naming the checkpoint saved on the
    way out; the same command again resumes there and ends as the uninterrupted run."""
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "job.toml", run, nproc=1)
    nodes = ("--launch.simulate_nodes", "2")
    proc = start_train(spec, *nodes)
    wait_for(lambda: (h := heartbeat(run, 0)) and h["step"] >= 13, timeout=180, what="step 13", interval=0.01)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 143, err[-3000:]
    (stop,) = records(run, "stop")
    s = stop["step"]
    msg = " ".join(err.split())
    assert f"error: stopped by SIGTERM: the workers saved step-{s:08d} at step {s} on the way out" in msg
    assert msg.count("error: stopped by SIGTERM") == 1  # the node agents leave the report to the parent
    rc, out, err = finish(start_train(spec, *nodes))
    assert rc == 0, err[-3000:]
    result = json.loads(out)
    assert records(run, "start")[-1]["start_step"] == s and result["step"] == 45
    assert_bitwise_equal(final_state(result["checkpoint"]), reference["state"])


@pytest.mark.parametrize("nodes", [0, 2], ids=["one-node", "2-simulated-nodes"])
def test_ctrl_c_stops_with_a_checkpoint_and_says_so(tmp_path, nodes):
    """Ctrl-C in a terminal: SIGINT to every process of the foreground job. The workers save at
    an agreed step as on SIGTERM; exit 130 with one true line naming that checkpoint and what a
    rerun does; no process of the job outlives it."""
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "job.toml", run, nproc=1 if nodes else 2)
    extra = ("--launch.simulate_nodes", str(nodes)) if nodes else ()
    proc = start_train(spec, *extra, own_group=True)
    wait_for(lambda: (h := heartbeat(run, 0)) and h["step"] >= 5, timeout=180, what="step 5", interval=0.01)
    os.killpg(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc)
    assert rc == 130, err[-3000:]
    (stop,) = records(run, "stop")
    s = stop["step"]
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert lines == [f"error: stopped by SIGINT: the workers saved step-{s:08d} at step {s} on the way out. "
                     f"Fix: run the same command again: it resumes from {run / 'checkpoints' / f'step-{s:08d}'}"], err
    assert (run / "checkpoints" / f"step-{s:08d}" / "manifest.json").is_file()
    assert processes_with(str(run)) == []
