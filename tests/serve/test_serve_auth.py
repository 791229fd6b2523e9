"""`tandem serve --api-key-file`: 401 without a valid key (the same answer whatever was wrong), health
checks open, keys never in any log; bad key files refused in one line without echoing a key."""

from __future__ import annotations

import os

import pytest

from serve.serve_helpers import Server
from tandem.serve.auth import ApiKeys, presented_key
from tandem_testing import run_tandem

KEY_A = "k-" + "a1" * 16
KEY_B = "k-" + "b2" * 16


def test_check_accepts_only_the_keys():
    keys = ApiKeys([KEY_A, KEY_B])
    assert keys.check(KEY_A) and keys.check(KEY_B)
    for bad in (None, "", KEY_A[:-1], KEY_A + "x", KEY_A.upper(), " " + KEY_A):
        assert not keys.check(bad), bad
    assert presented_key({"authorization": f"Bearer {KEY_A}"}) == KEY_A
    assert presented_key({"authorization": f"bearer  {KEY_A} "}) == KEY_A
    assert presented_key({"authorization": f"Basic {KEY_A}"}) is None
    assert presented_key({"x-api-key": KEY_B}) == KEY_B


@pytest.mark.slow  # a server of its own (front and replica processes): ~6.5 s
def test_api_keys_gate_every_route_but_health(gpt_export, tmp_path):
    kf = tmp_path / "keys.txt"
    kf.write_text(f"# serving keys\n{KEY_A}\n\n{KEY_B}\n")
    os.chmod(kf, 0o600)
    with Server(gpt_export, tmp_path / "srv", "--api-key-file", str(kf),
                headers={"authorization": f"Bearer {KEY_A}"}) as srv:
        body = {"prompt": [1, 2], "max_new_tokens": 2}
        c = srv.client
        ok = c.post("/v1/generate", json=body)
        assert ok.status_code == 200, ok.text
        assert c.post("/v1/generate", json=body, headers={"authorization": "", "x-api-key": KEY_B}).status_code == 200
        denied = [
            c.post("/v1/generate", json=body, headers={"authorization": ""}),                # no key
            c.post("/v1/generate", json=body, headers={"authorization": f"Bearer {KEY_A}x"}),  # wrong key
            c.post("/v1/generate", json=body, headers={"authorization": f"Basic {KEY_A}"}),  # other scheme
            c.post("/v1/generate", content=b"{bad json", headers={"authorization": "Bearer nope"}),  # before 400
            c.get("/v1/info", headers={"authorization": ""}),
            c.get("/metrics", headers={"authorization": ""}),
            c.get("/openapi.json", headers={"authorization": ""}),
        ]
        assert [r.status_code for r in denied] == [401] * len(denied)
        assert len({r.text for r in denied}) == 1  # one answer: nothing says which part failed
        assert all(r.headers["www-authenticate"] == "Bearer" for r in denied)
        for path in ("/livez", "/readyz"):
            assert c.get(path, headers={"authorization": ""}).status_code == 200
        m = srv.metrics()
        assert m[("/v1/generate", "401")] == 4 and m[("/v1/generate", "200")] == 2
        out = srv.output()
        assert "2 API key(s) required" in out
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "srv").iterdir() if p.is_file())
    assert KEY_A not in logs and KEY_B not in logs


def test_bad_key_files_are_refused_without_echoing_a_key(gpt_export, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    r = run_tandem("serve", str(gpt_export), "--api-key-file", str(empty), timeout=60)
    assert r.returncode == 2 and f"error: --api-key-file: holds no key (got '{empty}')" in r.stderr, r.stderr
    short = tmp_path / "short"
    short.write_text(f"{KEY_A}\nhunter2\n")
    r = run_tandem("serve", str(gpt_export), "--api-key-file", str(short), timeout=60)
    assert r.returncode == 2 and "key 2 (of 2) is shorter than 16 characters" in r.stderr, r.stderr
    assert "hunter2" not in r.stderr + r.stdout and KEY_A not in r.stderr + r.stdout
    r = run_tandem("serve", str(gpt_export), "--api-key-file", str(tmp_path / "missing"), timeout=60)
    assert r.returncode == 2 and "error: --api-key-file: cannot read it" in r.stderr
