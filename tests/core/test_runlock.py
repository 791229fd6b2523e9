"""The run dir's lock: a live owner refuses a second job; a dead owner's lock is taken over."""

import json
import os
import subprocess
import sys

import pytest

from tandem.core.errors import LaunchError
from tandem.core.runlock import RunLock, process_start


def _owner(run, proc):
    (run / ".lock").write_text(json.dumps({"pid": proc.pid, "host": os.uname().nodename,
                                           "start": process_start(proc.pid), "since": 0}))


def test_a_live_owner_refuses_and_a_dead_one_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        _owner(run, owner)
        with pytest.raises(LaunchError) as e:
            RunLock(run).acquire()
        assert f"in use by a live `tandem train` (pid {owner.pid}" in str(e.value)
        assert e.value.field == "launch.run_dir" and f"kill {owner.pid}" in e.value.fix
    finally:
        owner.stdin.close()
        owner.wait(timeout=30)
    said = []
    lock = RunLock(run).acquire(said.append)  # the owner is gone (its pid reaped): stale
    assert said == [f"run dir lock {run / '.lock'}: its owner, pid {owner.pid} on {os.uname().nodename}, is gone "
                    "(killed or crashed); taking it over"]
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    with pytest.raises(LaunchError):  # held by this live process now
        RunLock(run).acquire()
    lock.release()
    assert not (run / ".lock").exists() and list(run.iterdir()) == []
    RunLock(run).acquire().release()  # free again: no line


def test_a_lock_of_another_host_is_refused_with_how_to_clear_it(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": 0}))
    with pytest.raises(LaunchError) as e:
        RunLock(tmp_path).acquire()
    assert "locked by a job on another host (pid 1 on elsewhere" in str(e.value)
    assert f"remove {tmp_path / '.lock'}" in e.value.fix
