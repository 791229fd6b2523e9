"""`--replicas MIN:MAX`: the policy fed observations (no clock), and a real server over loopback that
adds a replica under a bounded burst and removes it when idle, in that order, logged and counted."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve.serve_helpers import Server, wait_for
from tandem.serve.autoscale import ScalePolicy, Scaler, parse_replicas, recent_p99_ms


def test_parse_replicas():
    assert parse_replicas("3") == (3, 3) and parse_replicas("1:4") == (1, 4)


def test_policy_scales_up_only_after_a_sustained_deep_queue_and_down_after_sustained_idle():
    s = Scaler(ScalePolicy(1, 3, up_queue=4, up_s=1.0, down_s=5.0))
    assert s.observe(0.0, depth=9, busy=1, live=1, loading=0) is None      # deep, but not for long yet
    assert s.observe(0.5, depth=2, busy=1, live=1, loading=0) is None      # a dip resets the timer
    assert s.observe(0.6, depth=9, busy=1, live=1, loading=0) is None
    up = s.observe(1.6, depth=9, busy=1, live=1, loading=0)
    assert up is not None and (up.direction, up.before, up.after) == ("up", 1, 2) and "depth 9" in up.reason
    # the new replica is loading: no second decision until it serves, however deep the queue
    assert s.observe(5.0, depth=50, busy=1, live=1, loading=1) is None
    assert s.observe(5.1, depth=50, busy=2, live=2, loading=0) is None     # the period starts again
    assert s.observe(6.2, depth=50, busy=2, live=2, loading=0).after == 3
    assert s.observe(9.0, depth=50, busy=3, live=3, loading=0) is None     # at MAX: never more
    # idle: queue empty and a replica free, sustained for down_s
    assert s.observe(10.0, depth=0, busy=2, live=3, loading=0) is None
    assert s.observe(12.0, depth=0, busy=3, live=3, loading=0) is None     # all busy: not idle, reset
    assert s.observe(13.0, depth=0, busy=0, live=3, loading=0) is None
    down = s.observe(18.0, depth=0, busy=0, live=3, loading=0)
    assert (down.direction, down.before, down.after) == ("down", 3, 2)
    assert s.observe(23.0, depth=0, busy=0, live=2, loading=0) is None     # the period starts again
    assert s.observe(28.0, depth=0, busy=0, live=2, loading=0).after == 1
    assert s.observe(99.0, depth=0, busy=0, live=1, loading=0) is None     # at MIN: never fewer


def test_policy_scales_up_on_a_sustained_high_p99_with_a_shallow_queue():
    s = Scaler(ScalePolicy(1, 3, up_queue=100, up_s=1.0, down_s=5.0, up_p99_ms=200))
    assert s.observe(0.0, depth=3, busy=1, live=1, loading=0, p99_ms=450) is None   # slow, not for long yet
    assert s.observe(0.5, depth=3, busy=1, live=1, loading=0, p99_ms=150) is None   # a dip resets the timer
    assert s.observe(0.6, depth=3, busy=1, live=1, loading=0, p99_ms=450) is None
    assert s.observe(1.2, depth=3, busy=1, live=1, loading=0, p99_ms=None) is None  # nothing answered: reset
    assert s.observe(1.3, depth=3, busy=1, live=1, loading=0, p99_ms=450) is None
    up = s.observe(2.4, depth=3, busy=1, live=1, loading=0, p99_ms=451)
    assert (up.direction, up.before, up.after, up.signal) == ("up", 1, 2, "p99")
    assert up.reason == "p99 above 200 ms for 1 s (p99 451 ms over the last 5 s)"
    # a loading replica: the p99 still describes the smaller pool, so the period waits for it to serve
    assert s.observe(2.5, depth=3, busy=1, live=1, loading=1, p99_ms=900) is None
    assert s.observe(4.0, depth=3, busy=1, live=1, loading=1, p99_ms=900) is None
    assert s.observe(4.1, depth=3, busy=2, live=2, loading=0, p99_ms=900) is None
    assert s.observe(5.1, depth=3, busy=2, live=2, loading=0, p99_ms=900).after == 3
    assert s.observe(9.0, depth=3, busy=3, live=3, loading=0, p99_ms=900) is None   # at MAX: never more
    # the queue signal still works beside it, and says which signal fired
    q = Scaler(ScalePolicy(1, 2, up_queue=4, up_s=1.0, up_p99_ms=200))
    assert q.observe(0.0, depth=9, busy=1, live=1, loading=0, p99_ms=10) is None
    assert q.observe(1.0, depth=9, busy=1, live=1, loading=0, p99_ms=10).signal == "queue"


def test_recent_p99_counts_only_answers_in_the_window():
    from collections import deque

    recent = deque([(0.0, 9.0)] + [(100.0 + i, 0.001 * (i + 1)) for i in range(200)])
    # 200 answers of 1..200 ms: the one at index int(0.99 * 200), 199 ms (the 9 s one is out of the window)
    assert recent_p99_ms(recent, 100.0) == pytest.approx(199.0)
    assert recent[0][0] == 100.0                               # and, a minute older, dropped
    assert recent_p99_ms(recent, 299.0) == pytest.approx(200.0) and recent_p99_ms(recent, 400.0) is None


def test_policy_ignores_p99_when_off():
    s = Scaler(ScalePolicy(1, 3, up_queue=100, up_s=1.0))    # up_p99_ms 0: the default, off
    assert all(s.observe(t, depth=3, busy=1, live=1, loading=0, p99_ms=5000) is None for t in range(10))


@pytest.mark.slow
def test_server_scales_up_under_a_burst_and_back_down_when_idle(gpt_export, tmp_path):
    run = tmp_path / "srv"
    with Server(gpt_export, run, "--replicas", "1:2", "--max-batch", "1", "--batch-wait-ms", "0",
                "--scale-up-queue", "2", "--scale-up-s", "0.5", "--scale-down-s", "1") as srv:
        events = run / "autoscale.jsonl"

        def decisions() -> list[dict]:
            return [json.loads(ln) for ln in events.read_text().splitlines()] if events.is_file() else []
        codes: list[int] = []
        stop = threading.Event()

        def burst(_):  # waves of 12 requests until the pool scales up; bounded at 25 waves
            for _wave in range(25):
                if stop.is_set():
                    return
                with ThreadPoolExecutor(12) as ex:
                    codes.extend(ex.map(lambda i: srv.client.post(
                        "/v1/generate", json={"prompt": [i % 16], "max_new_tokens": 15}).status_code, range(12)))
        with ThreadPoolExecutor(2) as load:
            waves = [load.submit(burst, k) for k in range(2)]
            wait_for(lambda: any(d["direction"] == "up" for d in decisions()) or all(w.done() for w in waves),
                     300, "a scale-up decision")
            wait_for(lambda: srv.client.get("/readyz").json()["ready_replicas"] == 2 or all(w.done() for w in waves),
                     300, "the second replica serving")
            stop.set()
            for w in waves:
                w.result()
        assert codes and set(codes) == {200}, sorted(set(codes))
        up_pids = srv.pids()
        assert len(up_pids) == 2 and None not in up_pids
        wait_for(lambda: any(d["direction"] == "down" for d in decisions()), 120, "a scale-down decision")
        wait_for(lambda: len(srv.pids()) == 1, 60, "replicas.json with one replica")
        wait_for(lambda: not _alive(up_pids[1]), 60, "the removed replica's exit")
        d = decisions()
        assert [(x["direction"], x["before"], x["after"]) for x in d] == [("up", 1, 2), ("down", 2, 1)]
        assert srv.pids() == up_pids[:1]  # the first replica stayed
        m = srv.client.get("/metrics").text
        assert 'tandem_serve_autoscale_decisions_total{direction="up",signal="queue"} 1.0' in m
        assert 'tandem_serve_autoscale_decisions_total{direction="down",signal="idle"} 1.0' in m
        assert "tandem_serve_replicas_target 1.0" in m
        assert srv.client.post("/v1/generate", json={"prompt": [1], "max_new_tokens": 2}).status_code == 200
    out = srv.output()
    assert "autoscale: 1 -> 2 replica(s): queue above 2 for 0.5 s" in out
    assert "autoscale: 2 -> 1 replica(s): queue empty" in out
    assert out.index("autoscale: 1 -> 2") < out.index("autoscale: 2 -> 1") < out.index("stopped (scaled down)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
