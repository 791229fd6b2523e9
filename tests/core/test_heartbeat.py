"""Heartbeat files: rewritten in place through a memory map, read back whole or not at all."""

import json
import subprocess
import sys
import time
import zlib

from tandem.core import heartbeat as hb
from tandem.train.elastic.resume import previous_attempt


def test_beats_rewrite_the_page_in_place_and_a_restart_keeps_the_last_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.delenv("TANDEM_ATTEMPT", raising=False)
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
    code = ("import os, signal, sys; from tandem.core.heartbeat import Heartbeat; "
            "h = Heartbeat(sys.argv[1], 0, 0); [h.beat(i) for i in range(1, 501)]; "
            "os.kill(os.getpid(), signal.SIGKILL)")
    rc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=120).returncode
    assert rc == -9
    assert hb.read(tmp_path / "heartbeat" / "rank-0.json")["step"] == 500


def test_a_half_written_page_reads_as_nothing(tmp_path):
    path = tmp_path / "rank-0.json"
    text = json.dumps({"rank": 0, "step": 1}).encode()
    path.write_bytes(text + b"\n%08x" % zlib.crc32(text) + b" " * 100)
    assert hb.read(path) == {"rank": 0, "step": 1}
    path.write_bytes(text[:-3] + b"2}" + b"\n%08x" % zlib.crc32(text))  # valid JSON, not what was written
    assert hb.read(path, tries=3) is None
    path.write_bytes(b'{"rank": 0, "st' + b"\0" * 10)
    assert hb.read(path, tries=3) is None


def test_every_torn_copy_is_refused(tmp_path):
    """A reader copying while the writer copies sees the new page up to some byte and the old
    one after it. Some of those mixes are valid JSON with wrong values; none may be accepted."""
    beat = hb.Heartbeat(tmp_path, rank=0, local_rank=0)
    pages = []
    for step in (10**15, 7):
        beat.beat(step, "step")
        pages.append((tmp_path / "heartbeat" / "rank-0.json").read_bytes())
    old, new = pages
    good = [hb.parse(old), hb.parse(new)]
    mixes = [new[:k] + old[k:] for k in range(len(old))] + [old[:k] + new[k:] for k in range(len(old))]
    plain = [m.strip(b" \0").rpartition(b"\n")[0] for m in mixes]
    fooled = [t for t in plain if _loads(t) not in (None, *good)]
    assert fooled, "no torn copy parses as other valid JSON: this test would prove nothing"
    assert all(hb.parse(m) in (None, *good) for m in mixes)


def _loads(text: bytes):
    try:
        return json.loads(text)
    except ValueError:
        return None


def test_a_reader_racing_the_writer_never_gets_a_torn_beat(tmp_path):
    """Beats of alternating lengths (a step of 1 digit, then 16) shift the later fields; a
    torn copy can still be valid JSON with a wrong time. Every beat read must be one written."""
    code = ("import sys; from tandem.core.heartbeat import Heartbeat; h = Heartbeat(sys.argv[1], 0, 0); "
            "print('up', flush=True)\n"
            "for i in range(400000): h.beat(1 if i % 2 else 10**15 + i, 'step' if i % 3 else 'sync')")
    t0 = time.time()
    w = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    path = tmp_path / "heartbeat" / "rank-0.json"
    reads = 0
    try:
        w.stdout.readline()
        while w.poll() is None and reads < 30000:
            b = hb.parse(path.read_bytes())  # one raw try: torn pages must be refused, not mended
            if b is None:
                continue
            reads += 1
            assert b["step"] == 1 or b["step"] >= 10**15, b
            assert t0 <= b["step_time"] <= b["time"] <= time.time(), b
    finally:
        w.kill()
        w.wait()
    assert reads > 1000


def test_previous_attempt_takes_the_heartbeat_when_it_is_ahead_of_the_records(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("TANDEM_ATTEMPT", raising=False)
    recs = [{"kind": "start", "time": 100.0, "start_step": 0}, {"kind": "step", "time": 110.0, "step": 17}]
    beats = [{"run_id": "r1", "attempt": 0, "step": 18, "time": 111.5, "step_time": 111.0},
             {"run_id": "r1", "attempt": 1, "step": 30, "time": 130.0, "step_time": 130.0},  # this attempt
             {"run_id": "other", "attempt": 0, "step": 99, "time": 99.0, "step_time": 99.0}]  # another run
    assert previous_attempt(recs, beats) == {"last_step": 18, "last_time": 111.0, "attempts": 1}
    assert previous_attempt(recs, beats[1:]) == {"last_step": 17, "last_time": 110.0, "attempts": 1}
    stale = {"run_id": "r1", "attempt": 0, "step": 25, "time": 90.0, "step_time": 90.0}  # before the records
    assert previous_attempt(recs, [stale]) == {"last_step": 17, "last_time": 110.0, "attempts": 1}

