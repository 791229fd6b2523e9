"""A real `tandem serve` over loopback: outputs equal `tandem.export.load` run directly (1 and 2 replicas),
and every bad input gets its code without touching a replica."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tandem.export
from serve.serve_helpers import Server, greedy


@pytest.fixture(scope="module")
def servers(gpt_export, resnet_export, text_gpt_export, tmp_path_factory):
    """(model, replicas) -> a running server, started on first use, stopped at the end of the module."""
    running: dict[tuple[str, int], Server] = {}

    def get(model: str, replicas: int) -> Server:
        key = (model, replicas)
        if key not in running:
            exp = {"gpt": gpt_export, "resnet": resnet_export, "gpt256": text_gpt_export}[model]
            s = Server(exp, tmp_path_factory.mktemp(f"{model}-{replicas}"), "--replicas", str(replicas),
                       "--batch-wait-ms", "20")
            running[key] = s.__enter__()
        return running[key]
    yield get
    with ThreadPoolExecutor(len(running) or 1) as ex:  # each waits for its own replicas to stop: side by side
        list(ex.map(lambda s: s.__exit__(None, None, None), running.values()))


@pytest.mark.parametrize("replicas", [1, 2])
def test_predict_bitwise_equal_to_direct_load(servers, resnet_export, replicas):
    srv = servers("resnet", replicas)
    model = tandem.export.load(resnet_export)
    shape = json.loads((resnet_export / "config.json").read_text())["example_input"]["shape"][1:]
    x = torch.randn(24, *shape, generator=torch.Generator().manual_seed(replicas))
    sizes = [1, 3, 2, 1, 4, 1, 2, 3, 1, 2, 4]          # 24 examples in 11 concurrent requests
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def ask(i: int):
        r = srv.client.post("/v1/predict", json={"inputs": x[starts[i]:starts[i] + sizes[i]].tolist()})
        assert r.status_code == 200, r.text
        return r.json()["outputs"]
    with ThreadPoolExecutor(8) as ex:
        got = [y for ys in ex.map(ask, range(len(sizes))) for y in ys]
    with torch.no_grad():
        want = model(x)
    assert torch.equal(torch.tensor(got, dtype=torch.float32), want)  # bitwise, whatever the batches were


@pytest.mark.parametrize("replicas", [1, 2])
def test_generate_greedy_equals_direct_load(servers, gpt_export, replicas):
    srv = servers("gpt", replicas)
    model = tandem.export.load(gpt_export)
    g = torch.Generator().manual_seed(10 + replicas)
    prompts = [torch.randint(0, 16, (int(n),), generator=g).tolist() for n in (8, 3, 12, 1, 8, 5)]
    news = [8, 5, 5, 16, 2, 0]   # up to seq + 1 - len(prompt)

    def ask(i: int):
        r = srv.client.post("/v1/generate", json={"prompt": prompts[i], "max_new_tokens": news[i]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(ask, range(len(prompts))))
    assert got == [greedy(model, p, n) for p, n in zip(prompts, news)]


def test_sampling_is_deterministic_with_a_seed(servers):
    srv = servers("gpt", 2)
    body = {"prompt": [1, 2, 3, 4], "max_new_tokens": 10, "temperature": 1.5, "top_k": 8}
    with ThreadPoolExecutor(6) as ex:  # concurrent: batched with each other in varying ways
        runs = list(ex.map(lambda s: srv.client.post("/v1/generate", json={**body, "seed": s % 3}).json()["tokens"],
                           range(6)))
    assert runs[0] == runs[3] and runs[1] == runs[4] and runs[2] == runs[5]
    assert len({tuple(r) for r in runs}) > 1  # different seeds give different samples (fails if seed is ignored)


def _post(srv, path: str, content: bytes):
    return srv.client.post(path, content=content, headers={"content-type": "application/json"})


def _b64(a) -> dict:
    import base64

    return {"b64": base64.b64encode(a.numpy().tobytes()).decode(), "shape": list(a.shape),
            "dtype": str(a.dtype).removeprefix("torch.")}


def test_bad_inputs_get_their_code_name_the_field_and_no_replica_dies(servers):
    gpt, res = servers("gpt", 1), servers("resnet", 1)
    pids = gpt.pids(), res.pids()
    shape = json.loads((res.export_dir / "config.json").read_text())["example_input"]["shape"][1:]
    good = torch.zeros(1, *shape).tolist()
    nan = json.dumps({"inputs": good}).replace("0.0", "NaN", 1).encode()
    x = torch.zeros(2, *shape)
    x_nan = x.clone()
    x_nan[1, 0, 2, 3] = float("nan")
    b64 = _b64(x)

    def j(o) -> bytes:
        return json.dumps(o).encode()
    cases = [  # (server, route, body, code, the error's field, a piece of its message)
        (gpt, "/v1/generate", b'{"prompt": [1, 2', 400, "", "not valid JSON"),
        (gpt, "/v1/generate", b"[1, 2, 3]", 400, "", "must be a JSON object"),
        (gpt, "/v1/generate", b"[" * 100000 + b"]" * 100000, 400, "", "not valid JSON"),
        (gpt, "/v1/generate", b'{"prompt": [1, 99]}', 422, "prompt[1]", "out of the vocabulary 0..15"),
        (gpt, "/v1/generate", b'{"prompt": [1, 2], "max_new_tokens": 16}', 422, "max_new_tokens", "at most 15"),
        (gpt, "/v1/generate", b'{"prompt": "12"}', 422, "prompt", "valid list"),
        (gpt, "/v1/generate", b'{"prompt": [1, 2.5]}', 422, "prompt[1]", "valid integer"),
        (gpt, "/v1/generate", b'{"prompt": [1], "temperature": 1e999}', 422, "temperature", "finite"),
        (gpt, "/v1/generate", b'{"prompt": [1], "timeout_ms": -5}', 422, "timeout_ms", "greater than or equal"),
        (gpt, "/v1/generate", b'{"prompt": [1], "max_tokens": 4}', 422, "max_tokens", "unknown field"),
        (gpt, "/v1/generate", b'{"max_new_tokens": 4}', 422, "prompt", "exactly one of prompt"),
        (gpt, "/v1/generate", b'{"text": "12"}', 422, "text", "not byte-level"),
        (res, "/v1/predict", nan, 422, "inputs[0][0][0][0]", "not a finite float32"),
        (res, "/v1/predict", j({"inputs": [good[0][:-1]]}), 422, "inputs[0]", "expected a list of"),
        (res, "/v1/predict", j({"inputs": [[["x"]]]}), 422, "inputs[0][0]", "expected a list of 8 (got a list of 1)"),
        (res, "/v1/predict", j({"inputs": [[[["x"] * 8] * 8]]}), 422, "inputs[0][0][0][0]",
         "expected a number (got str)"),
        (res, "/v1/predict", j({"inputs": good * 33}), 422, "inputs", "more than --max-batch 32"),
        (res, "/v1/predict", j({}), 422, "inputs", "is required"),
        (res, "/v1/predict", j({"inputs": {**b64, "b64": b64["b64"][:-8]}}), 422, "inputs.b64", "bytes where"),
        (res, "/v1/predict", j({"inputs": {**b64, "b64": "%%%"}}), 422, "inputs.b64", "not valid base64"),
        (res, "/v1/predict", j({"inputs": {**b64, "dtype": "int64"}}), 422, "inputs.dtype", "takes float32"),
        (res, "/v1/predict", j({"inputs": {**b64, "shape": [2, 8, 8]}}), 422, "inputs.shape", "expected [N, "),
        (res, "/v1/predict", j({"inputs": {**b64, "dtype": "float16"}}), 422, "inputs.dtype", "float32"),
        (res, "/v1/predict", j({"inputs": _b64(x_nan)}), 422, "inputs[1][0][2][3]", "nan is not finite"),
        (res, "/v1/predict", b"0" * (9 << 20), 413, "", "over the limit"),
        (res, "/v1/generate", b'{"prompt": [1]}', 422, "route", "use /v1/predict"),
    ]
    for srv, path, body, code, field, msg in cases:
        r = _post(srv, path, body)
        assert r.status_code == code, (path, body[:60], r.status_code, r.text)
        err = r.json()
        assert err.get("field", "") == field and msg in err["error"], (body[:60], err)
        assert not field or err["error"].startswith(field + ": ")
    assert gpt.client.get("/v1/nowhere").status_code == 404
    assert gpt.client.get("/v1/generate").status_code == 405
    assert gpt.client.post("/v1/generate", json={"prompt": [1, 2]}).status_code == 200
    assert res.client.post("/v1/predict", json={"inputs": good}).status_code == 200
    assert (gpt.pids(), res.pids()) == pids  # no replica died or was restarted


def test_base64_predict_is_bitwise_and_answers_base64(servers, resnet_export):
    import base64

    import numpy as np

    srv = servers("resnet", 1)
    shape = json.loads((resnet_export / "config.json").read_text())["example_input"]["shape"][1:]
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(3))
    r = srv.client.post("/v1/predict", json={"inputs": _b64(x)})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]
    got = np.frombuffer(base64.b64decode(out["b64"]), dtype="<f4").reshape(out["shape"])
    with torch.no_grad():
        want = tandem.export.load(resnet_export)(x)
    assert out["dtype"] == "float32" and torch.equal(torch.from_numpy(got.copy()), want)
    lists = srv.client.post("/v1/predict", json={"inputs": x.tolist()}).json()["outputs"]
    assert torch.equal(torch.tensor(lists), want)  # the same numbers either way


@pytest.mark.slow  # the module's one server of the byte-level GPT (its own processes): ~6-10 s
def test_text_prompt_is_byte_level_tokens(servers, text_gpt_export):
    srv = servers("gpt256", 1)
    r = srv.client.post("/v1/generate", json={"text": "héllo", "max_new_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = list("héllo".encode())  # 6 bytes: the é is two
    assert body["prompt"] == prompt
    assert body["tokens"] == greedy(tandem.export.load(text_gpt_export), prompt, 6)
    assert body["text"] == bytes(body["tokens"]).decode("utf-8", errors="replace")
    same = srv.client.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 6}).json()
    assert same["tokens"] == body["tokens"] and "text" not in same
    long = srv.client.post("/v1/generate", json={"text": "x" * 17})
    assert long.status_code == 422 and long.json()["error"] == "text: expected 1..16 tokens (got 17)"
    assert srv.client.get("/v1/info").json()["model"]["text"] is True


def test_openapi_documents_the_request_bodies(servers):
    doc = servers("gpt", 1).client.get("/openapi.json").json()
    gen = doc["paths"]["/v1/generate"]["post"]
    props = gen["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"prompt", "text", "max_new_tokens", "temperature", "top_k", "seed", "timeout_ms"} <= set(props)
    assert "422" in gen["responses"] and "inputs" in \
        doc["paths"]["/v1/predict"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]


def test_bounded_fuzz_gives_no_5xx_and_a_healthy_server(servers):
    import random

    rng = random.Random(7)
    gpt, res = servers("gpt", 1), servers("resnet", 1)
    pids = gpt.pids(), res.pids()
    values = [None, True, -1, 0, 2**70, -1e308, 1e308, 1.5, "x", "", [], {}, [[[]]], {"a": 1}, [1] * 100,
              [[0.5] * 3] * 3, "\u0000", "9" * 400]

    def rand_value(depth=0):
        if depth < 3 and rng.random() < 0.3:
            return [rand_value(depth + 1) for _ in range(rng.randrange(4))]
        return rng.choice(values)

    bodies = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) for _ in range(6)]
    bodies += [json.dumps({k: rand_value() for k in rng.sample(
        ["inputs", "prompt", "max_new_tokens", "temperature", "top_k", "seed", "other"], 3)}).encode()
               for _ in range(16)]
    bodies += [b"{" * 5000, b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", b"", b"null", b'"str"', b"1e999"]
    for srv in (gpt, res):
        for body in bodies:
            for path in ("/v1/predict", "/v1/generate"):
                r = _post(srv, path, body)
                assert r.status_code < 500, (path, body[:80], r.status_code, r.text)
            assert srv.client.request("PUT", "/readyz", content=body).status_code == 405
    assert gpt.client.get("/readyz").status_code == 200 and res.client.get("/readyz").status_code == 200
    assert (gpt.pids(), res.pids()) == pids


def test_bench_serve_cli_reports_what_the_server_counted(servers, tmp_path):
    from tandem_testing import run_tandem

    srv = servers("resnet", 2)
    before = srv.metrics().get(("/v1/predict", "200"), 0)
    r = run_tandem("bench", "serve", srv.url, "--rate", "20", "--duration", "1.5", "--json", str(tmp_path / "b.json"),
                   "--plot", str(tmp_path / "latency.png"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["sent"] == 30 and res["codes"] == {"200": 30} and res["route"] == "/v1/predict"
    assert "30 sent, 30 ok, 0 failed" in r.stdout and "p99" in r.stdout
    assert srv.metrics()[("/v1/predict", "200")] - before == 30
    assert [s[2] for s in res["samples"]] == ["200"] * 30 and res["samples"][-1][0] == pytest.approx(29 / 20)
    bad = run_tandem("bench", "serve", srv.url, "--rate", "0")
    assert bad.returncode == 2 and "error: --rate: must be positive" in bad.stderr
