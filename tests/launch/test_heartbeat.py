"""Heartbeat files: rewritten in place through a memory map, read back whole or not at all."""

import json
import subprocess
import sys

from tandem.launch import heartbeat as hb
from tandem.train.elastic.resume import previous_attempt


def test_beats_rewrite_the_page_in_place_and_a_restart_keeps_the_last_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    beat = hb.Heartbeat(tmp_path, rank=1, local_rank=1)
    path = tmp_path / "heartbeat" / "rank-1.json"
    assert hb.read(path) is None  # created, never written: nothing to report
    beat.beat(1234567, "sync")
    beat.beat(8, "step")  # a shorter text must not leave the longer one's tail behind
    b = hb.read(path)
    assert (b["rank"], b["step"], b["phase"], b["attempt"], b["run_id"]) == (1, 8, "step", 0, "r1")
    assert b["step_time"] == b["time"]
    beat.beat(8, "sync")
    b2 = hb.read(path)
    assert b2["phase"] == "sync" and b2["step_time"] == b["step_time"] and b2["time"] >= b["time"]
    assert path.stat().st_size == hb.SIZE
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    hb.Heartbeat(tmp_path, rank=1, local_rank=1)  # the next attempt's rank: no beat yet
    assert hb.read(path) == b2  # the failed attempt's progress is still there to account for
    assert [x["rank"] for x in hb.read_all(tmp_path)] == [1]


def test_a_killed_writer_leaves_its_last_beat(tmp_path):
    code = ("import os, signal, sys; from tandem.launch.heartbeat import Heartbeat; "
            "h = Heartbeat(sys.argv[1], 0, 0); [h.beat(i) for i in range(1, 501)]; "
            "os.kill(os.getpid(), signal.SIGKILL)")
    rc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=120).returncode
    assert rc == -9
    assert hb.read(tmp_path / "heartbeat" / "rank-0.json")["step"] == 500


def test_a_half_written_page_reads_as_nothing(tmp_path):
    path = tmp_path / "rank-0.json"
    path.write_bytes(b'{"rank": 0, "step": 1' + b" " * 100)
    assert hb.read(path, tries=3) is None
    path.write_bytes(json.dumps({"rank": 0}).encode() + b"\0" * 10)
    assert hb.read(path) == {"rank": 0}


def test_previous_attempt_takes_the_heartbeat_when_it_is_ahead_of_the_records(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    recs = [{"kind": "start", "time": 100.0, "start_step": 0}, {"kind": "step", "time": 110.0, "step": 17}]
    beats = [{"run_id": "r1", "attempt": 0, "step": 18, "time": 111.5, "step_time": 111.0},
             {"run_id": "r1", "attempt": 1, "step": 30, "time": 130.0, "step_time": 130.0},  # this attempt
             {"run_id": "other", "attempt": 0, "step": 99, "time": 99.0, "step_time": 99.0}]  # another run
    assert previous_attempt(recs, beats) == {"last_step": 18, "last_time": 111.0, "attempts": 1}
    assert previous_attempt(recs, beats[1:]) == {"last_step": 17, "last_time": 110.0, "attempts": 1}
