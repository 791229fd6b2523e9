"""A tensor-parallel replica (--tp 2: two processes on one gloo group, each loading its tp-R-of-2 shards):
logits within 1e-5 of the single-process model and the same greedy tokens; SIGKILL of the second rank takes
the whole replica down, the pool restarts it, and the requests sent meanwhile are answered, none failed."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tandem.export
from export.export_helpers import write_checkpoint
from serve.serve_helpers import Server, greedy, wait_for


@pytest.fixture(scope="module")
def tp_export(tmp_path_factory):
    from tandem.cli import main

    root = tmp_path_factory.mktemp("serve-tp")
    run = write_checkpoint(root / "run")
    try:
        main(["export", str(run), "--out", str(root / "export"), "--tp", "2"])
    except SystemExit as e:
        assert not e.code
    return root / "export"


@pytest.mark.slow
def test_tp2_replica_equals_one_process_and_survives_a_rank_kill(tp_export, tmp_path):
    model = tandem.export.load(tp_export)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 16, (int(n),), generator=g).tolist() for n in (8, 3, 12, 1)]
    news = [8, 5, 5, 16]
    with Server(tp_export, tmp_path / "srv", "--tp", "2", "--hang-s", "30") as srv:
        x = torch.randint(0, 16, (3, 16), generator=g)
        r = srv.client.post("/v1/predict", json={"inputs": x.tolist()})
        assert r.status_code == 200, r.text
        with torch.no_grad():
            want = model(x)
        assert torch.allclose(torch.tensor(r.json()["outputs"]), want, atol=1e-5, rtol=0)

        def ask(i: int):
            r = srv.client.post("/v1/generate", json={"prompt": prompts[i % 4], "max_new_tokens": news[i % 4]})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(ask, range(4)))
        assert got == [greedy(model, p, n) for p, n in zip(prompts, news)]

        doc = json.loads((srv.run_dir / "replicas.json").read_text())["replicas"][0]
        assert len(doc["tp_pids"]) == 1
        os.kill(doc["tp_pids"][0], signal.SIGKILL)       # rank 1 of the replica
        with ThreadPoolExecutor(4) as ex:               # sent while the replica goes down and comes back
            again = list(ex.map(ask, range(8)))
        assert again == got + got
        wait_for(lambda: srv.client.get("/readyz").status_code == 200, 120, "the tp replica back")
        new = json.loads((srv.run_dir / "replicas.json").read_text())["replicas"][0]
        assert new["pid"] != doc["pid"] and new["tp_pids"] != doc["tp_pids"]
        assert srv.metrics()[("tandem_serve_replica_restarts_total", "")] == 1
    log = (srv.run_dir / "replica-0.log").read_text()
    # rank 0 goes down either way: its watcher saw rank 1 exit, or a collective with rank 1 failed first
    assert "exited with -9: the replica goes down with it" in log or "; exiting" in log, log[-2000:]
