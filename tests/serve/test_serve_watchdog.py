"""The hang watchdog on a real server over loopback, with faults injected inside the replica
(TANDEM_SERVE_FAULTS, serve/faults.py): a request the replica loses is answered 500 after --hang-s even
while the replica keeps answering steady traffic from others, and a request that kills every replica it
reaches is retried once, then answered 500, instead of restarting replicas forever."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve.serve_helpers import Server, wait_for

pytestmark = pytest.mark.slow   # a server of its own, and a replica killed twice (each restart loads the export)

LOSE, KILL = 13, 14


@pytest.fixture(scope="module")
def srv(gpt_export, tmp_path_factory):
    with Server(gpt_export, tmp_path_factory.mktemp("watchdog"), "--hang-s", "2", "--batch-wait-ms", "0",
                env={"TANDEM_SERVE_FAULTS": f"lose:token={LOSE},sigkill:token={KILL}"}) as s:
        yield s


def test_a_request_lost_inside_a_busy_replica_is_answered_500(srv):
    stop, steady = threading.Event(), []

    def traffic():   # a request in flight at every moment: the replica is never silent
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            while not stop.is_set():
                steady.append(c.post("/v1/generate", json={"prompt": [3, 2], "max_new_tokens": 14}).status_code)

    with ThreadPoolExecutor(2) as ex:
        busy = [ex.submit(traffic) for _ in range(2)]
        lost = srv.client.post("/v1/generate", json={"prompt": [LOSE, 1], "max_new_tokens": 4})
        stop.set()
        for f in busy:
            f.result()
    assert lost.status_code == 500, lost.text
    err = lost.json()["error"]
    assert err.startswith("request ") and "decoded no token of it in 2 s" in err and "not retried" in err
    assert steady and set(steady) == {200}
    m = srv.metrics()
    assert m[("tandem_serve_requests_given_up_total", "lost")] == 1
    assert m[("tandem_serve_replica_restarts_total", "")] == 0   # the replica answered others: not killed
    rid = err.split()[1]
    assert f"decoded no token of request {rid} in 2 s while it answered others" in srv.output()


def test_a_request_that_kills_replicas_is_retried_once_then_answered_500(srv):
    r = srv.client.post("/v1/generate", json={"prompt": [KILL, 1], "max_new_tokens": 4})
    assert r.status_code == 500 and "2 replicas died holding it; not retried" in r.json()["error"], r.text
    assert "retry-after" not in r.headers
    m = srv.metrics()
    assert m[("tandem_serve_requests_given_up_total", "replicas_died")] == 1
    # the answer goes out when the second replica's death fails the request; the restart is counted just after
    wait_for(lambda: srv.metrics()[("tandem_serve_replica_restarts_total", "")] >= 2, 60, "second restart counted")
    wait_for(lambda: srv.client.get("/readyz").status_code == 200, 120, "replica back")
    assert srv.metrics()[("tandem_serve_replica_restarts_total", "")] == 2   # not a third: it was not retried again
    ok = srv.client.post("/v1/generate", json={"prompt": [3], "max_new_tokens": 2})
    assert ok.status_code == 200
