"""The official `openai` client against a real `tandem serve` over loopback: a GPT whose export folder
holds a BPE tokenizer.json (trained here with `tandem data prepare-text --tokenizer bpe`) and a
tokenizer_config.json with a chat template. One server for the module (its last test drains it)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import httpx
import pytest

from serve.serve_helpers import Server, greedy, wait_for

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow   # a server with a replica, and a 512-token context to decode through
KEY = "sk-test-openai-key"
MODEL = "tiny-bpe"   # --served-model-name
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
WORDS = "the quick brown fox jumps over lazy dog serve tandem tokens stream model cache batch replica".split()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(export folder, token folder, tokenizers.Tokenizer): a GPT of the BPE's vocabulary, seq 512."""
    import random

    from tokenizers import Tokenizer

    from export.export_helpers import write_checkpoint
    from serve.serve_helpers import export
    from tandem.data.text import prepare_text

    root = tmp_path_factory.mktemp("oai")
    (root / "src").mkdir()
    rng = random.Random(0)
    (root / "src" / "a.txt").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)))
    man = prepare_text([str(root / "src")], root / "tok", globs=["*"], tokenizer="bpe", vocab=300, held_out=0.1)
    run = write_checkpoint(root / "run", model_overrides={"vocab": man["vocab"], "seq": 512})
    exp = export(run, root / "export")
    shutil.copy(root / "tok" / "tokenizer.json", exp / "tokenizer.json")
    (exp / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return exp, root / "tok", Tokenizer.from_file(str(exp / "tokenizer.json"))


@pytest.fixture(scope="module")
def srv(bpe, tmp_path_factory):
    run = tmp_path_factory.mktemp("oai-serve")
    (run / "keys").write_text(KEY + "\n")
    os.chmod(run / "keys", 0o600)
    with Server(bpe[0], run / "serve", "--max-batch", "4", "--max-queue", "8", "--max-body", "65536",
                "--api-key-file", str(run / "keys"), "--served-model-name", MODEL,
                headers={"authorization": f"Bearer {KEY}"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def _metric(srv, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(srv.client.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_models_and_greedy_completion_equal_tandem_generate(client, bpe, capsys):
    import tandem.export
    from tandem.cli import main

    exp, tok_dir, tok = bpe
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = "the quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == 12
    ids = tok.encode(prompt).ids
    assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + 12
    assert ch.model_extra["token_ids"] == greedy(tandem.export.load(exp), ids, 12)
    capsys.readouterr()
    try:
        main(["generate", str(exp), "--prompt", prompt, "--tokens", "12", "--temperature", "0",
              "--data", str(tok_dir)])
    except SystemExit as e:
        assert not e.code
    printed = capsys.readouterr().out.split("\n", 1)[1]   # after its "# 12 tokens from ..." line
    assert printed.rstrip("\n") == prompt + ch.text


def test_token_id_prompts_and_several_prompts(client, bpe):
    _, _, tok = bpe
    a, b = tok.encode("lazy dog").ids, tok.encode("stream model cache").ids
    r = client.completions.create(model=MODEL, prompt=[a, b], max_tokens=5, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    by_text = client.completions.create(model=MODEL, prompt=["lazy dog", "stream model cache"], max_tokens=5,
                                        temperature=0)
    assert [c.text for c in r.choices] == [c.text for c in by_text.choices]
    assert [c.text for c in r.choices] == [tok.decode(c.model_extra["token_ids"]) for c in r.choices]
    assert r.usage.prompt_tokens == len(a) + len(b) == by_text.usage.prompt_tokens
    assert r.usage.completion_tokens == 10


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream(client, bpe, chat):
    _, _, tok = bpe
    kw = dict(model=MODEL, max_tokens=20, temperature=0.9, seed=7)
    if chat:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox"}]
        whole = client.chat.completions.create(messages=msgs, **kw)
        chunks = list(client.chat.completions.create(messages=msgs, stream=True,
                                                     stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert text == whole.choices[0].message.content
        rendered = "<system>be brief\n<user>the fox\n<assistant>"   # the export's own template
        assert whole.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False).ids)
    else:
        whole = client.completions.create(prompt="the lazy", **kw)
        chunks = list(client.completions.create(prompt="the lazy", stream=True,
                                                stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) <= {None}
    assert not chunks[-1].choices and chunks[-1].usage == whole.usage   # include_usage: the last chunk
    assert whole.usage.completion_tokens == 20


def test_raw_sse_ends_with_done(srv):
    with srv.client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "fox", "max_tokens": 4,
                                                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_strings_and_stop_token_ids(client, bpe):
    _, _, tok = bpe
    kw = dict(model=MODEL, prompt="tokens stream", max_tokens=40, temperature=1.0, seed=11)
    full = client.completions.create(extra_body={"return_token_ids": True}, **kw).choices[0]
    text, ids = full.text, full.model_extra["token_ids"]
    k = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    stop = text[k:k + 2]
    cut = client.completions.create(stop=[stop, "\x00never"], **kw)
    assert cut.choices[0].text == text[:k] and cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == text[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"
    j = next(i for i in range(2, len(ids)) if ids.index(ids[i]) == i)   # a token's first occurrence
    r = client.completions.create(extra_body={"stop_token_ids": [ids[j]], "return_token_ids": True}, **kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["token_ids"] == ids[:j] and c.text == tok.decode(ids[:j])
    assert r.usage.completion_tokens == j + 1   # the stop token was generated, not returned


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="the dog", max_tokens=16, temperature=1.2, top_p=0.9, extra_body={"top_k": 50})
    a = client.completions.create(seed=5, n=3, **kw)
    b = client.completions.create(seed=5, n=3, **kw)
    c = client.completions.create(seed=6, n=3, **kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert len({x.text for x in a.choices}) > 1                          # n choices: n different samples
    assert [x.text for x in a.choices] != [x.text for x in c.choices]    # the seed is used


def _error(e: "openai.APIStatusError") -> dict:
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_error_schema_for_each_4xx(client, srv):
    noauth = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        noauth.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert _error(e.value)["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as e:       # 400: an argument OpenAI's API does not have
        client.completions.create(model=MODEL, prompt="x", extra_body={"bogus": 1})
    assert _error(e.value)["param"] == "bogus"
    with pytest.raises(openai.BadRequestError) as e:       # 400: past the context
        client.completions.create(model=MODEL, prompt="x", max_tokens=600)
    assert _error(e.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert _error(e.value)["param"] == "logprobs"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert _error(e.value)["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as e:        # 413: over --max-body
        client.completions.create(model=MODEL, prompt="x" * 70000)
    assert e.value.status_code == 413 and _error(e.value)["type"] == "invalid_request_error"
    for bad in ({"temperature": -1}, {"top_p": 5}, {"prompt": [[1, 2], [300]]}, {"n": 0}):
        with pytest.raises(openai.UnprocessableEntityError) as e:
            client.completions.create(**{"model": MODEL, "prompt": "x", **bad})
        assert _error(e.value)["param"].startswith(next(iter(bad)))
    with pytest.raises(openai.RateLimitError) as e:        # 429: 16 choices at once into a queue of 8
        client.completions.create(model=MODEL, prompt="x", n=16, max_tokens=2)
    assert _error(e.value)["code"] == "rate_limit_exceeded" and e.value.response.headers["retry-after"] == "1"
    raw = srv.client.post("/v1/completions", content=b"{not json")
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("stream", [False, True])
def test_bench_serve_openai_measures_token_timing(srv, stream):
    import asyncio

    from tandem.bench.serve import run_openai_load

    res = asyncio.run(run_openai_load(srv.url, rate=4, duration=1, stream=stream, max_tokens=24, api_key=KEY,
                                      prompt="the quick brown fox"))
    assert res["sent"] == res["ok"] == 4 and res["codes"] == {"200": 4}
    assert res["output_tokens_per_s"] > 0 and res["max_tokens"] == 24
    assert 0 < res["ttft_ms"]["p50"] <= res["ttft_ms"]["p99"] <= res["latency_ms"]["p99"]
    if stream:   # 24 tokens in several chunks: the gaps between them are the ITL samples
        assert res["itl_ms"]["samples"] > 0 and 0 <= res["itl_ms"]["p50"] <= res["itl_ms"]["p99"]
        assert res["ttft_ms"]["p50"] <= res["latency_ms"]["p50"]
    else:
        assert res["itl_ms"] is None and res["ttft_ms"] == res["latency_ms"]


def test_disconnect_frees_the_slot_at_the_next_step(client, srv):
    """The client goes away after its first chunk of a 500-token stream: the replica drops it long
    before its 500th decode step, and its slot and the running gauge are free again."""
    aborted = _metric(srv, "vllm:request_success_total", finished_reason="abort")
    decoded = _metric(srv, "tandem_serve_cancelled_decoded_tokens_total")
    with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "fox", "max_tokens": 500,
                                                       "temperature": 0, "stream": True}) as r:
            first = next(line for line in r.iter_lines() if line)
            assert first.startswith("data: {")
    wait_for(lambda: _metric(srv, "tandem_serve_cancelled_sequences_total") >= 1, 60, "the replica's cancel")
    assert _metric(srv, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    steps = _metric(srv, "tandem_serve_cancelled_decoded_tokens_total") - decoded
    assert 1 <= steps < 250   # tokens it had decoded when it dropped the sequence: far from 500
    wait_for(lambda: _metric(srv, "vllm:num_requests_running") == 0, 60, "running back to 0")
    assert _metric(srv, "vllm:kv_cache_usage_perc") == 0
    assert client.completions.create(model=MODEL, prompt="fox", max_tokens=3).choices[0].finish_reason == "length"


def test_replica_killed_mid_stream_ends_with_an_error_event(client, srv):
    """The stream that sent text ends with an error event; a non-streamed request on the same replica
    (nothing sent yet) is retried on the restarted one and answered whole."""
    from concurrent.futures import ThreadPoolExecutor

    stream = client.completions.create(model=MODEL, prompt="cache", max_tokens=500, temperature=0, stream=True)
    it = iter(stream)
    assert next(it).choices[0].text is not None
    # stopped, the replica decodes nothing more: the stream cannot end and the second request, written to
    # its pipe by the front (the "running" gauge counts it then), gets no token before the kill
    pid = srv.pids()[0]
    os.kill(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as ex:
        quiet = ex.submit(client.completions.create, model=MODEL, prompt="batch replica", max_tokens=480,
                          temperature=0)
        wait_for(lambda: _metric(srv, "vllm:num_requests_running") == 2, 60, "both on the replica")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                pass
        assert "died" in str(e.value)
        whole = quiet.result(timeout=180)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 480
    again = client.completions.create(model=MODEL, prompt="batch replica", max_tokens=480, temperature=0)
    assert again.choices[0].text == whole.choices[0].text
    wait_for(srv._ready, 120, "the replica back")


def test_sigterm_drain_finishes_admitted_streams_and_refuses_new_ones(client, srv):
    """Last in the module: it stops the server."""
    stream = client.completions.create(model=MODEL, prompt="model", max_tokens=500, temperature=0, stream=True)
    it = iter(stream)
    texts = [next(it).choices[0].text]
    srv.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "draining" in srv.output(), 30, "the drain to begin")
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert e.value.status_code == 503 and _error(e.value)["code"] == "draining"
    chunks = list(it)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(texts) + len(chunks) >= 2
    assert srv.proc.wait(60) == 0
