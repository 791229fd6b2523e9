"""`tandem serve HF_DIR --engine vllm`: tandem's front over real vLLM OpenAI-server replicas (the side venv
of `make vllm`), on a Llama trained here by `tandem train` and exported by `tandem export --format hf`.

Greedy tokens equal the local engine's on the same run's tandem-format export, token for token; the
official `openai` client talks to it; a replica SIGKILLed under a bounded concurrent load loses no
request (each is sent again to the other replica), its whole process group goes, and it is started
again. A vLLM start takes 45-90 s here, so one trained model and one 2-replica server serve the module.
Outside CI a machine without `.venv-vllm` skips these with the reason; under CI they must run.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from serve.serve_helpers import Server
from tandem_testing import ROOT, one_line_error, run_tandem, skip_here_fail_in_ci, tandem_in_process, wait_for

SPEC = ROOT / "examples" / "llama_reverse.toml"
# 8 digits then the separator 10: the reverse task's prompts (the model answers with 8 tokens)
PROMPTS = [[(7 * i + 3 * j) % 10 for j in range(8)] + [10] for i in range(8)]


def _vllm_python() -> str:
    from tandem.serve.vllm_engine import DEFAULT_PYTHON, PYTHON_ENV

    py = os.environ.get(PYTHON_ENV) or str(DEFAULT_PYTHON)
    if not os.access(py, os.X_OK):
        skip_here_fail_in_ci(f"no vLLM venv at {py} (make vllm)", "the vLLM engine tests (.ci/run runs make vllm)")
    return py


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> tuple[Path, Path]:
    """A Llama of head_dim 32 (vLLM's CPU attention needs >= 32) trained 40 steps on 1 rank, exported in both
    formats: (tandem folder, Hugging Face folder)."""
    _vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    r = run_tandem("train", str(SPEC), "--model.heads", "2", "--model.kv_heads", "1", "--launch.nproc_per_node", "1",
                   "--schedule.max_steps", "40", "--launch.run_dir", str(root / "run"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for fmt, out in (("tandem", root / "tandem"), ("hf", root / "hf")):
        r = run_tandem("export", str(root / "run"), "--format", fmt, "--out", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((root / "hf" / "config.json").read_text())["head_dim"] == 32
    return root / "tandem", root / "hf"


@pytest.fixture(scope="module")
def vllm_srv(exports, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm-serve")
    with Server(exports[1], run, "--engine", "vllm", "--replicas", "2", "--max-batch", "16",
                "--served-model-name", "tiny-llama", ready_timeout=600) as s:
        yield s


def _generate(srv, prompt) -> list[int]:
    r = srv.client.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 8})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.slow
def test_greedy_equals_the_local_engine_and_the_openai_client_talks_to_it(exports, vllm_srv, tmp_path):
    openai = pytest.importorskip("openai")
    with Server(exports[0], tmp_path / "local") as local:
        want = [_generate(local, p) for p in PROMPTS]
    got = [_generate(vllm_srv, p) for p in PROMPTS]
    assert got == want
    assert all(len(t) == 8 for t in got)

    c = openai.OpenAI(base_url=vllm_srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in c.models.list().data] == ["tiny-llama"]
    out = c.completions.create(model="tiny-llama", prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    by_index = sorted(out.choices, key=lambda ch: ch.index)
    # an export without a tokenizer answers token ids (tandem's front tokenizes; vLLM gets and gives ids)
    assert [ch.model_extra["token_ids"] for ch in by_index] == want[:3]
    assert out.usage.completion_tokens == 24 and {ch.finish_reason for ch in by_index} == {"length"}
    # streamed: the front forwards vLLM's stream chunk by chunk; the usage counts every token
    chunks = list(c.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 8
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # stop_token_ids are the front's: it cuts the choice at the first one and vLLM drops the rest
    stop = want[0][2]
    out = c.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                               extra_body={"stop_token_ids": [stop], "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == want[0][:want[0].index(stop)]
    assert out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError):   # the front's own checks, before any replica
        c.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=64)
    m = vllm_srv.metrics()
    assert m[("/v1/generate", "200")] == len(PROMPTS) and m[("/v1/completions", "200")] == 3


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(d.name))
    return out


@pytest.mark.slow
def test_a_replica_killed_under_load_fails_no_request(vllm_srv):
    want = {i: _generate(vllm_srv, p) for i, p in enumerate(PROMPTS)}
    pids = vllm_srv.pids()
    assert len(pids) == 2 and all(_group(p) for p in pids)   # API server, EngineCore, worker: one group each
    total, workers = 96, 6
    results: dict[int, tuple[int, object]] = {}
    answered = threading.Semaphore(0)
    lock = threading.Lock()

    def work(w: int) -> None:
        with httpx.Client(base_url=vllm_srv.url, timeout=300) as c:
            for k in range(w, total, workers):
                i = k % len(PROMPTS)
                try:
                    r = c.post("/v1/completions", json={"model": "tiny-llama", "prompt": PROMPTS[i], "max_tokens": 8,
                                                        "temperature": 0})
                    res = (r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text)
                except httpx.HTTPError as e:
                    res = (0, repr(e))
                with lock:
                    results[k] = res
                answered.release()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for _ in range(total // 4):   # a quarter answered: the load is running on both replicas
        assert answered.acquire(timeout=300)
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(600)
    failed = {k: v for k, v in results.items() if v[0] != 200}
    assert len(results) == total and not failed, failed
    assert all(results[k][1] == want[k % len(PROMPTS)] for k in results)   # the retried ones too
    # the killed replica's whole group is gone (vLLM's EngineCore outlives its API server otherwise) and
    # the slot serves again with a new process
    wait_for(lambda: not _group(pids[0]), 60, "the killed replica's process group to exit")
    wait_for(lambda: vllm_srv.client.get("/readyz").json()["ready_replicas"] == 2, 600, "the restarted replica")
    doc = json.loads((vllm_srv.run_dir / "replicas.json").read_text())
    assert doc["engine"] == "vllm" and doc["replicas"][0]["restarts"] == 1 and doc["replicas"][0]["pid"] != pids[0]
    m = vllm_srv.metrics()
    assert m[("tandem_serve_replica_restarts_total", "")] == 1
    assert _generate(vllm_srv, PROMPTS[0]) == want[0]
    # SIGTERM drains and stops every replica group
    vllm_srv.proc.send_signal(signal.SIGTERM)
    assert vllm_srv.proc.wait(120) == 0
    left = [p for p in vllm_srv.pids() if p and _group(p)]
    assert not left, left


def test_what_the_vllm_engine_cannot_serve_is_refused_in_one_line(gpt_export, tmp_path, capsys, monkeypatch):
    """Before any process starts, with no vLLM needed: a tandem-format folder, a head size vLLM's CPU
    attention lacks, no vLLM venv, flags the engine does not take."""
    hf = tmp_path / "hf"
    hf.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16, "hidden_size": 64,
           "num_attention_heads": 4, "max_position_embeddings": 16}
    (hf / "config.json").write_text(json.dumps(cfg))
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    cases = [([str(gpt_export)], "EXPORT_DIR", "tandem-format export"),
             ([str(hf), "--vllm-python", str(py)], "config.json", "head_dim 16"),
             ([str(hf), "--vllm-python", str(tmp_path / "nope")], "--vllm-python", "make vllm"),
             ([str(hf), "--replicas", "1:2"], "--replicas", "fixed"),
             ([str(hf), "--batching", "static"], "--batching", "continuously"),
             ([str(hf), "--address", "127.0.0.1:1"], "--address", "--engine ray")]
    cfg["head_dim"] = 32
    for args, field, words in cases:
        code, out, err = tandem_in_process(["serve", *args, "--engine", "vllm"], capsys, monkeypatch)

        class R:   # one_line_error's shape
            returncode, stderr = code, err
        one_line_error(R, f"{field}: ", words)
        if field == "config.json":
            (hf / "config.json").write_text(json.dumps(cfg))   # head_dim 32 from here on
