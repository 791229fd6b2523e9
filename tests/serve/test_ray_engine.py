"""`tandem serve --engine ray` on a real 2-node Ray cluster on this machine (ray.cluster_utils: a head
node and a second node, each its own raylet): replicas on both nodes, the local engine's API
expectations, and a replica of the second node killed under load without a failed request."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tandem.export
from serve.serve_helpers import ROOT, Server, greedy, wait_for
from tandem_testing import skip_here_fail_in_ci, tandem_in_process


def _need_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        skip_here_fail_in_ci("ray is not installed (pip install 'tandem[ray]'; make install installs the ray extra)",
                             "the Ray engine tests")


@pytest.fixture(scope="module")
def cluster():
    """A head node and a second node, 2 logical CPUs each, in a temp dir of their own (Ray's address
    file and sockets live there, so other Ray instances on this machine neither see nor meet it)."""
    _need_ray()
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="trt", dir="/tmp")   # short: Ray's unix socket paths must fit 107 bytes
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "PYTHONPATH")}
    os.environ["RAY_TMPDIR"] = tmp
    # the replicas (worker processes of these raylets) import this checkout's tandem
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                          "object_store_memory": 100 << 20})
        second = c.add_node(num_cpus=2, object_store_memory=100 << 20)
        yield c, c.head_node.node_id, second.node_id
    finally:
        if c is not None:
            c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def server(cluster, gpt_export, tmp_path_factory):
    """The GPT as `tandem serve --engine ray --replicas 2` on the cluster. A GPT answers /v1/predict too
    (tokens in, logits out), so one server covers both routes. Ray's @serve.batch holds a request up
    to --batch-wait-ms for its batch to fill: 3 s keeps every replica holding accepted requests while
    the load of the kill test runs."""
    s = Server(gpt_export, tmp_path_factory.mktemp("ray-gpt"), "--engine", "ray", "--address", cluster[0].address,
               "--replicas", "2", "--batch-wait-ms", "3000", ready_timeout=300)
    with s:
        yield s
    # SIGTERM: drained, the app deleted, Ray left cleanly (Ray's own SIGTERM handler once aborted it here)
    assert s.proc.returncode == 0 and "serve: stopped" in s.output(), s.output()


def _replicas(srv) -> list[dict]:
    return json.loads((srv.run_dir / "replicas.json").read_text())["replicas"]


@pytest.mark.slow
def test_replicas_on_both_nodes_and_outputs_equal_direct_load(server, cluster, gpt_export):
    _, head, second = cluster
    wait_for(lambda: sum(r["ready"] for r in _replicas(server)) == 2, 30, "2 replicas in replicas.json")
    assert {r["node"] for r in _replicas(server)} == {head, second}, _replicas(server)
    model = tandem.export.load(gpt_export)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 16, (16, 16), generator=g)
    sizes = [1, 3, 2, 1, 4, 2, 3]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    prompts = [torch.randint(0, 16, (int(n),), generator=g).tolist() for n in (8, 3, 12, 1)]
    news = [8, 5, 5, 16]

    def predict(i: int):
        r = server.client.post("/v1/predict", json={"inputs": x[starts[i]:starts[i] + sizes[i]].tolist()})
        assert r.status_code == 200, r.text
        return r.json()["outputs"]

    def generate(i: int):
        r = server.client.post("/v1/generate", json={"prompt": prompts[i], "max_new_tokens": news[i]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    with ThreadPoolExecutor(11) as ex:   # all at once: one batch window
        got = ex.map(predict, range(len(sizes)))
        toks = ex.map(generate, range(len(prompts)))
        got, toks = [y for ys in got for y in ys], list(toks)
    with torch.no_grad():
        want = model(x)
    assert torch.equal(torch.tensor(got, dtype=torch.float32), want)  # bitwise, whatever Ray batched
    assert toks == [greedy(model, p, n) for p, n in zip(prompts, news)]


@pytest.mark.slow
def test_bad_inputs_get_the_local_engines_codes(server):
    pids = [r["pid"] for r in _replicas(server)]
    cases = [("/v1/generate", b'{"prompt": [1, 2', 400, ""), ("/v1/generate", b"[1]", 400, ""),
             ("/v1/generate", b'{"prompt": [1, 99]}', 422, "prompt[1]"),
             ("/v1/generate", b'{"prompt": [1], "max_tokens": 4}', 422, "max_tokens"),
             ("/v1/predict", b'{"inputs": [[1, 2]]}', 422, "inputs[0]"),
             ("/v1/predict", json.dumps({"inputs": [[1] * 15 + [16]]}).encode(), 422, "inputs[0][15]"),
             ("/v1/predict", b"0" * (9 << 20), 413, "")]
    for path, body, code, field in cases:
        r = server.client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == code and r.json()["field"] == field, (path, body[:40], r.status_code, r.text)
    assert server.client.get("/v1/nowhere").status_code == 404
    assert server.client.get("/v1/generate").status_code == 405
    assert server.client.get("/readyz").json() == {"status": "ready", "ready_replicas": 2, "replicas": 2,
                                                   "draining": False}
    counted = server.metrics()
    assert counted[("/v1/generate", "400")] == 2 and counted[("/v1/predict", "422")] == 2
    assert [r["pid"] for r in _replicas(server)] == pids   # no replica was touched


@pytest.mark.slow
def test_killing_the_second_nodes_replica_under_load_loses_no_request(server, cluster):
    """Open-loop load; once 10 requests are outstanding (each replica holds accepted ones in its batch
    window) the second node's replica is SIGKILLed: its requests come back as RayActorError, the front
    sends them again, and every request is answered 200."""
    from tandem.bench.serve import run_load

    second = cluster[2]
    victim = next(r["pid"] for r in _replicas(server) if r["node"] == second)
    before = server.metrics().get(("/v1/generate", "200"), 0)
    out: dict = {}
    load = threading.Thread(target=lambda: out.update(asyncio.run(run_load(server.url, rate=10, duration=6,
                                                                           max_new_tokens=4))))
    load.start()
    try:
        wait_for(lambda: server.metrics().get(("tandem_serve_inflight", ""), 0) >= 10, 60, "10 requests outstanding")
    finally:
        os.kill(victim, signal.SIGKILL)
        load.join(180)
    assert out["sent"] == 60 and out["codes"] == {"200": 60}, out["codes"]
    text = server.client.get("/metrics").text
    retried = float(next(ln.split()[-1] for ln in text.splitlines()
                         if ln.startswith("tandem_serve_retried_batches_total")))
    assert retried >= 1   # requests the dead replica had accepted were sent again, not lost
    assert server.metrics()[("/v1/generate", "200")] - before == 60
    # Ray Serve starts a replacement on the second node (the only one with a CPU free for it)
    wait_for(lambda: sum(r["ready"] for r in _replicas(server)) == 2 and victim not in
             [r["pid"] for r in _replicas(server)], 120, "a replacement replica")
    assert {r["node"] for r in _replicas(server)} == {cluster[1], second}


def test_missing_ray_names_the_extra(gpt_export, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "tandem.serve.ray_engine", raising=False)
    try:
        code, _, err = tandem_in_process(["serve", str(gpt_export), "--engine", "ray"], capsys, monkeypatch)
    finally:   # the module imported here has no Ray: the next test imports it afresh
        import tandem.serve

        sys.modules.pop("tandem.serve.ray_engine", None)
        if hasattr(tandem.serve, "ray_engine"):
            delattr(tandem.serve, "ray_engine")
    assert code == 2 and "error: --engine: Ray Serve is not installed" in err and "tandem[ray]" in err, err


def test_bad_address_is_refused_before_anything_starts(gpt_export, tmp_path, capsys, monkeypatch):
    _need_ray()
    import socket

    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for addr, msg in ((f"127.0.0.1:{port}", "no Ray head answers there"), ("x", "not a Ray head address HOST:PORT"),
                      ("ray://x:1", "Ray Client addresses (ray://) are not supported")):
        code, _, err = tandem_in_process(["serve", str(gpt_export), "--engine", "ray", "--address", addr,
                                          "--run-dir", str(tmp_path)], capsys, monkeypatch)
        assert code == 2 and f"error: --address: {msg}" in err, err
    assert not list(tmp_path.iterdir())   # nothing written
    code, _, err = tandem_in_process(["serve", str(gpt_export), "--address", f"127.0.0.1:{port}"], capsys, monkeypatch)
    assert code == 2 and "error: --address: is for --engine ray" in err, err


def test_replicas_min_max_maps_onto_ray_serve_autoscaling(tmp_path):
    """No cluster: the options handed to serve.deployment(...).options() (ray_engine.deployment_options)."""
    from tandem.serve.autoscale import ScalePolicy
    from tandem.serve.ray_engine import deployment_options
    from tandem.serve.pool import PoolOptions

    fixed = deployment_options(PoolOptions(export=tmp_path, replicas=3, max_batch=32), nodes=2)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_replicas_per_node"] == 2 and fixed["max_ongoing_requests"] == 64
    auto = deployment_options(PoolOptions(export=tmp_path, replicas=1, max_batch=32, scale=ScalePolicy(
        1, 4, up_queue=10, up_s=2.0, down_s=30.0)), nodes=2)
    assert auto["num_replicas"] == "auto" and auto["max_replicas_per_node"] == 2   # MAX spread over 2 nodes
    assert auto["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 4,
                                          "target_ongoing_requests": 10, "upscale_delay_s": 2.0,
                                          "downscale_delay_s": 30.0}
    # a target above what one replica may hold could never be reached: capped at max_ongoing_requests
    big = deployment_options(PoolOptions(export=tmp_path, replicas=1, max_batch=4, scale=ScalePolicy(
        1, 2, up_queue=500)), nodes=1)
    assert big["autoscaling_config"]["target_ongoing_requests"] == big["max_ongoing_requests"] == 8
    if importlib.util.find_spec("ray") is not None:   # Ray Serve itself accepts them
        from ray import serve

        from tandem.serve.ray_engine import RayReplica
        cfg = serve.deployment(RayReplica).options(name="model", **auto)._deployment_config.autoscaling_config
        assert (cfg.min_replicas, cfg.max_replicas, cfg.target_ongoing_requests) == (1, 4, 10)


def test_p99_autoscaling_is_refused_on_the_ray_engine(gpt_export, tmp_path, capsys, monkeypatch):
    _need_ray()
    code, _, err = tandem_in_process(["serve", str(gpt_export), "--engine", "ray", "--replicas", "1:2",
                                      "--scale-up-p99-ms", "100", "--run-dir", str(tmp_path / "r")],
                                     capsys, monkeypatch)
    assert code == 2 and "error: --scale-up-p99-ms: p99 autoscaling is the local engine's" in err, err
    assert not (tmp_path / "r").exists()
