"""The front's limits on a real server over loopback: invalid Unicode is a 422 naming its field, a slow
upload is cut off with 408 (--body-timeout-s), connections beyond --max-connections get 503, two
credential headers are a 400 (not "the last one wins"), /v1/info shows no filesystem path, unknown routes
and methods answer the documented {"error", "field"} body; and at the end of a drain every request still
held (a body still arriving, a request its replica lost) gets a 503, and a replica that dies while
draining is not restarted."""

from __future__ import annotations

import os
import signal
import socket
import threading
from urllib.parse import urlparse

import httpx
import pytest

from serve.serve_helpers import Server, wait_for

pytestmark = pytest.mark.slow   # servers of their own (front and replica processes)

KEY = "k-" + "c3" * 16
LOSE = 13


def slow_upload(url: str, headers: str = "") -> socket.socket:
    """A POST whose headers announce 100 bytes of body, of which 9 are sent: the server waits for the rest."""
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=120)
    s.sendall(f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
              f"Content-Length: 100\r\n\r\n{{\"prompt\"".encode())
    return s


def status_of(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    return int(data.split()[1]) if data else 0


@pytest.fixture(scope="module")
def srv(gpt_export, text_gpt_export, tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    kf = root / "keys.txt"
    kf.write_text(KEY + "\n")
    os.chmod(kf, 0o600)
    with Server(text_gpt_export, root / "srv", "--api-key-file", str(kf), "--body-timeout-s", "10",
                "--max-connections", "4", headers={"authorization": f"Bearer {KEY}"}) as s:
        yield s


def test_bad_unicode_two_keys_info_and_router_errors(srv, tmp_path):
    r = srv.client.post("/v1/generate", content=b'{"text": "a\\ud800b", "max_new_tokens": 2}',
                        headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "text" and "lone surrogate" in r.json()["error"], r.text
    assert srv.client.post("/v1/generate", json={"text": "ab", "max_new_tokens": 2}).status_code == 200
    two = httpx.post(srv.url + "/v1/generate", json={"prompt": [1], "max_new_tokens": 1},
                     headers=[("authorization", f"Bearer {KEY}"), ("authorization", "Bearer someone-else")])
    assert two.status_code == 400 and two.json()["field"] == "authorization", two.text
    both = httpx.post(srv.url + "/v1/completions", json={"model": "gpt", "prompt": [1], "max_tokens": 1},
                      headers={"authorization": f"Bearer {KEY}", "x-api-key": KEY})
    assert both.status_code == 400 and both.json()["error"]["code"] == "duplicate_credentials", both.text
    info = srv.client.get("/v1/info")
    assert info.status_code == 200 and "run_dir" not in info.json()
    assert str(srv.run_dir) not in info.text and os.sep + "tmp" not in info.text
    nf = srv.client.get("/v1/nothing")
    assert nf.status_code == 404 and nf.json()["field"] == "route" and "/v1/nothing" in nf.json()["error"]
    na = srv.client.get("/v1/generate")
    assert na.status_code == 405 and na.json()["field"] == "route" and "GET" in na.json()["error"]


def test_slow_uploads_time_out_and_connections_are_bounded(srv):
    auth = f"Authorization: Bearer {KEY}\r\n"
    # --max-connections 4, and 5 uploads that hold their connections (accepted in order): at most 4 are
    # served (3 when the test client's keep-alive connection is still open), the others refused
    slow = [slow_upload(srv.url, auth) for _ in range(5)]
    with httpx.Client(base_url=srv.url, timeout=60) as fresh:   # one more connection: refused, not queued
        assert fresh.get("/livez").status_code == 503
    codes = [status_of(s) for s in slow]   # a served one is cut off after --body-timeout-s: 408
    assert set(codes) == {408, 503} and codes.count(408) in (3, 4) and codes[:3] == [408] * 3, codes
    m = srv.metrics()
    assert m[("/v1/generate", "408")] == codes.count(408) and m[("tandem_serve_inflight", "")] == 0
    assert srv.client.post("/v1/generate", json={"prompt": [1], "max_new_tokens": 2}).status_code == 200


def test_the_end_of_a_drain_answers_what_is_held_and_restarts_nothing(gpt_export, tmp_path):
    with Server(gpt_export, tmp_path / "srv", "--drain-s", "2", "--hang-s", "120", "--body-timeout-s", "120",
                env={"TANDEM_SERVE_FAULTS": f"lose:token={LOSE}"}) as srv:
        res = {}
        t = threading.Thread(target=lambda: res.update(lost=httpx.post(
            srv.url + "/v1/generate", json={"prompt": [LOSE, 1], "max_new_tokens": 2}, timeout=120)))
        t.start()
        wait_for(lambda: srv.metrics().get(("tandem_serve_inflight", "")) == 1 or None, 60, "the lost request held")
        up = slow_upload(srv.url)
        wait_for(lambda: srv.metrics().get(("tandem_serve_inflight", "")) == 2 or None, 60, "the upload held")
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "SIGTERM: draining 2" in srv.output() or None, 60, "the drain")
        os.kill(srv.pids()[0], signal.SIGKILL)   # dies while draining: not restarted
        assert status_of(up) == 503
        t.join()
        assert res["lost"].status_code == 503 and "--drain-s 2 s ran out" in res["lost"].json()["error"]
        assert srv.proc.wait(60) == 0
    out = srv.output()
    assert "while draining; not restarted" in out and "restarting" not in out
    assert "2 request(s) still held answered 503" in out
