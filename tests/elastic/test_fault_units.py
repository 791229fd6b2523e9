"""Fast pieces of the fault-tolerance machinery: watchdog on a real stopped process, data
position across world sizes, fault parsing, the restart report."""

import json
from pathlib import Path
import signal
import subprocess
import sys
import time

import pytest

from elastic.fault_helpers import wait_for
from tandem.core.errors import CheckpointError
from tandem.core.heartbeat import read_all
from tandem.launch.watchdog import Watchdog, proc_state
from tandem.train.checkpoint_meta import CheckpointMeta
from tandem.train.elastic import faults
from tandem.train.elastic.resume import carry_position, previous_attempt, restart_report
from tandem_testing import ROOT

CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tandem.core.heartbeat import Heartbeat
hb = Heartbeat({run!r}, rank={rank}, local_rank={rank})
hb.beat(7, "sync")
def stuck_in_a_collective():
    if {stop}:
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        signal.pause()
stuck_in_a_collective()
"""


def test_watchdog_names_the_stopped_rank_dumps_stacks_and_ends_the_group(tmp_path):
    kids = [subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(ROOT), run=str(tmp_path), rank=r,
                                                                   stop=r == 1)]) for r in range(2)]
    try:
        wait_for(lambda: len(read_all(tmp_path)) == 2 and proc_state(kids[1].pid) == "T", 30, "two heartbeats")
        dog = Watchdog(tmp_path, timeout_s=5.0)
        assert dog.check() is None  # fresh heartbeats: nothing to do
        report = dog.check(now=time.time() + 6.0)  # as if 6 s passed without progress
        rep = json.loads(report.read_text())
        assert rep["first_stopped_rank"] == 1 and "state T" in rep["why"]
        assert rep["last_collective"]["0"] == "gradient all-reduce of step 8"
        for k in kids:
            assert k.wait(timeout=10) == -signal.SIGKILL  # the group was ended
        files = rep["stack_files"]  # py-spy's dump when it is installed, faulthandler's otherwise
        assert "stuck_in_a_collective" in Path(files["1"]).read_text()  # dumped where it stopped
        assert "stuck_in_a_collective" in Path(files["0"]).read_text()
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()


def test_data_position_carries_over_world_sizes():
    meta = CheckpointMeta(step=10, epoch=0, consumed=160, world_size=2, data_world=2)
    assert carry_position(meta, 2, log=lambda *a, **k: None) == 160
    assert carry_position(meta, 1, log=lambda *a, **k: None) == 320
    assert carry_position(meta, 4, log=lambda *a, **k: None) == 80
    with pytest.raises(CheckpointError, match="does not divide by the new world size 3"):
        carry_position(meta, 3, log=lambda *a, **k: None)


def test_fault_spec_parsing_and_attempt_filter(monkeypatch):
    assert faults.parse("sigkill:rank=1:step=7, slow:rank=0:ms=40") == [
        {"kind": "sigkill", "rank": "1", "step": "7"}, {"kind": "slow", "rank": "0", "ms": "40"}]
    monkeypatch.delenv("TANDEM_ATTEMPT", raising=False)
    monkeypatch.setenv(faults.ENV, "slow:rank=1:ms=40,slow:rank=1:ms=5:attempt=1,slow:rank=1:ms=1:attempts=all")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert faults.slow_ms(1) == 41 and faults.slow_ms(0) == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.slow_ms(1) == 6
    monkeypatch.setenv("TANDEM_ATTEMPT", "0")  # the group agreed on another attempt (a join): that one counts
    assert faults.slow_ms(1) == 41
    monkeypatch.delenv(faults.ENV)
    assert faults.slow_ms(1) == 0


def test_restart_report_arithmetic():
    recs = [{"kind": "start", "time": 100.0, "start_step": 0},
            {"kind": "step", "time": 110.0, "step": 17}]
    prev = previous_attempt(recs)
    assert prev == {"last_step": 17, "last_time": 110.0, "attempts": 1}
    rep = restart_report(prev, 10, proc_start=112.0, first_step_time=125.5, step_s=0.5, hang=None)
    assert rep == {"restart": 1, "resumed_step": 10, "last_step_before": 17, "steps_redone": 7, "down_s": 2.0,
                   "startup_s": 13.0, "lost_s": 15.0}
    assert previous_attempt([]) is None
