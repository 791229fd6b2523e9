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
def servers(gpt_export, resnet_export, tmp_path_factory):
    """(model, replicas) -> a running server, started on first use, stopped at the end of the module."""
    running: dict[tuple[str, int], Server] = {}

    def get(model: str, replicas: int) -> Server:
        key = (model, replicas)
        if key not in running:
            exp = gpt_export if model == "gpt" else resnet_export
            s = Server(exp, tmp_path_factory.mktemp(f"{model}-{replicas}"), "--replicas", str(replicas),
                       "--batch-wait-ms", "20")
            running[key] = s.__enter__()
        return running[key]
    yield get
    for s in running.values():
        s.__exit__(None, None, None)


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
    news = [8, 5, 4, 15, 2, 0]

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


def test_bad_inputs_get_their_code_and_no_replica_dies(servers):
    gpt, res = servers("gpt", 1), servers("resnet", 1)
    pids = gpt.pids(), res.pids()
    shape = json.loads((res.export_dir / "config.json").read_text())["example_input"]["shape"][1:]
    good = torch.zeros(1, *shape).tolist()
    nan = json.dumps({"inputs": good}).replace("0.0", "NaN", 1).encode()
    cases = [
        (gpt, "/v1/generate", b'{"prompt": [1, 2', 400),                        # malformed JSON
        (gpt, "/v1/generate", b"[1, 2, 3]", 400),                               # not an object
        (gpt, "/v1/generate", b"[" * 100000 + b"]" * 100000, 400),              # absurd nesting
        (gpt, "/v1/generate", b'{"prompt": [1, 99]}', 422),                     # out of vocabulary
        (gpt, "/v1/generate", b'{"prompt": [1, 2], "max_new_tokens": 15}', 422),  # past the model's seq
        (gpt, "/v1/generate", b'{"prompt": "12"}', 422),                        # wrong type
        (gpt, "/v1/generate", b'{"prompt": [1], "temperature": 1e999}', 422),   # huge number
        (res, "/v1/predict", nan, 422),                                         # NaN
        (res, "/v1/predict", json.dumps({"inputs": [good[0][:-1]]}).encode(), 422),  # wrong shape
        (res, "/v1/predict", json.dumps({"inputs": [[["x"]]]}).encode(), 422),   # wrong dtype
        (res, "/v1/predict", json.dumps({"inputs": good * 33}).encode(), 422),   # more than --max-batch
        (res, "/v1/predict", b"0" * (9 << 20), 413),                            # over --max-body
        (res, "/v1/generate", b'{"prompt": [1]}', 422),                         # generate on a classifier
    ]
    for srv, path, body, code in cases:
        r = _post(srv, path, body)
        assert r.status_code == code, (path, body[:60], r.status_code, r.text)
        assert "error" in r.json()
    assert gpt.client.get("/v1/nowhere").status_code == 404
    assert gpt.client.get("/v1/generate").status_code == 405
    assert gpt.client.post("/v1/generate", json={"prompt": [1, 2]}).status_code == 200
    assert res.client.post("/v1/predict", json={"inputs": good}).status_code == 200
    assert (gpt.pids(), res.pids()) == pids  # no replica died or was restarted
