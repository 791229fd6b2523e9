"""Failures on a real server: a replica SIGKILLed under load, a full queue, SIGTERM with requests in flight.
Each compares the server's /metrics with what the client saw."""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve.serve_helpers import Server, wait_for
from tandem.bench.serve import run_load


@pytest.mark.slow
def test_sigkill_one_of_two_replicas_under_load_fails_no_request(gpt_export, tmp_path):
    with Server(gpt_export, tmp_path / "srv", "--replicas", "2") as srv:
        before = srv.pids()
        res = asyncio.run(run_load(srv.url, rate=25, duration=4, kill_at=1.0, run_dir=srv.run_dir))
        assert res["sent"] == 100
        assert res["failed"] == 0, res["codes"]
        assert res["kill"]["pid"] == before[0] and res["kill"]["back_after_s"] is not None
        after = srv.pids()
        assert after[0] not in (None, before[0]) and after[1] == before[1]
        m = srv.metrics()
        assert m[("tandem_serve_replica_restarts_total", "")] == 1
        assert m[("/v1/generate", "200")] == res["ok"] == 100
        assert srv.client.get("/readyz").json()["ready_replicas"] == 2
    from tandem.bench.serve_plot import plot_latency   # the kill and the replica's return marked on the plot

    assert plot_latency(res, tmp_path / "latency.png").stat().st_size > 0 and 0.9 < res["kill"]["at_s"] < 1.5


@pytest.mark.slow  # a server of its own (front and replica processes): ~6 s, as the module's other fault tests
def test_full_queue_answers_429_at_once_and_no_5xx(gpt_export, tmp_path):
    with Server(gpt_export, tmp_path / "srv", "--max-queue", "4", "--max-batch", "1", "--batch-wait-ms", "0") as srv:
        body = {"prompt": [3], "max_new_tokens": 15}

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                         limits=httpx.Limits(max_connections=None)) as c:
                return await asyncio.gather(*(c.post("/v1/generate", json=body) for _ in range(50)))
        rs = asyncio.run(burst())
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429}, codes
        # the first --max-queue are always admitted; more only if the replica took one before the rest arrived
        assert codes.count(429) >= 1 and codes.count(200) >= 4
        assert all(r.headers.get("retry-after") == "1" for r in rs if r.status_code == 429)
        m = srv.metrics()
        assert m[("/v1/generate", "200")] == codes.count(200)
        assert m[("/v1/generate", "429")] == codes.count(429)
        assert not [k for k in m if k[0].startswith("/v1/") and k[1].startswith("5")]


@pytest.mark.slow
def test_sigterm_drains_admitted_requests(gpt_export, tmp_path):
    # a long batch wait holds the admitted requests in the queue while SIGTERM arrives
    with Server(gpt_export, tmp_path / "srv", "--max-batch", "64", "--batch-wait-ms", "4000",
                "--drain-s", "60") as srv:
        with ThreadPoolExecutor(13) as ex:
            futs = [ex.submit(srv.client.post, "/v1/generate", json={"prompt": [i % 16, 1], "max_new_tokens": 4})
                    for i in range(12)]
            # and one whose deadline passes while it waits for its batch: dropped before the model, 504
            expired = ex.submit(srv.client.post, "/v1/generate", json={"prompt": [1], "timeout_ms": 500})
            wait_for(lambda: srv.metrics().get(("tandem_serve_inflight", "")) == 13, 30, "13 requests admitted")
            srv.proc.send_signal(signal.SIGTERM)
            ready = wait_for(lambda: srv.client.get("/readyz"), 10, "/readyz")
            late = srv.client.post("/v1/generate", json={"prompt": [1]})
            answers = [f.result() for f in futs]
            late_deadline = expired.result()
        assert ready.status_code == 503 and ready.json()["draining"]
        assert late.status_code == 503 and late.headers["retry-after"] == "1"
        assert [r.status_code for r in answers] == [200] * 12
        assert all(len(r.json()["tokens"]) == 4 for r in answers)
        assert late_deadline.status_code == 504 and "timeout_ms 500" in late_deadline.json()["error"]
        assert srv.proc.wait(60) == 0
    assert "draining 13 in-flight" in srv.output()


@pytest.mark.slow
def test_hung_replica_is_killed_restarted_and_its_batch_retried(gpt_export, tmp_path):
    with Server(gpt_export, tmp_path / "srv", "--replicas", "2", "--max-batch", "1", "--batch-wait-ms", "0",
                "--hang-s", "2") as srv:
        before = srv.pids()
        os.kill(before[0], signal.SIGSTOP)  # alive but never answers: only the hang timeout can tell
        try:
            with ThreadPoolExecutor(6) as ex:  # max batch 1: while replica 1 is busy, replica 0 gets one
                rs = list(ex.map(lambda i: srv.client.post("/v1/generate", json={"prompt": [i], "max_new_tokens": 8}),
                                 range(6)))
        finally:
            if before[0] in srv.pids():
                os.kill(before[0], signal.SIGCONT)
        assert [r.status_code for r in rs] == [200] * 6
        wait_for(lambda: srv.client.get("/readyz").json()["ready_replicas"] == 2 and None not in srv.pids(), 120,
                 "replica 0 back")
        assert srv.pids()[0] != before[0] and srv.pids()[1] == before[1]
        m = srv.metrics()
        assert m[("tandem_serve_replica_restarts_total", "")] == 1
    assert "answered nothing in 2 s; killing it" in srv.output()   # continuous batching's watchdog
