"""One bad sequence fails alone: a pick or a forward that breaks on one request answers that request with
an error, frees its slot, and leaves the tokens of the requests batched with it as they are alone; a tiny
positive temperature is greedy, not NaN. In process on the scheduler (counted in steps), then a real
server over loopback, whose export has one token whose embedding is NaN."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tandem.export
from serve.serve_helpers import Server, greedy
from tandem.serve.continuous import Decoder, Scheduler
from tandem.serve.replica import PickError, _pick

POISON = 13   # a token id the scheduler test's decoder refuses / the served export's NaN embedding row


class Breaking(Decoder):
    """A decoder whose forward raises whenever a batch holds the sequence prompted with POISON."""

    def __init__(self, model, slots):
        super().__init__(model, slots)
        self.bad: set[int] = set()

    def step(self, runs):   # runs: (slot, tokens, start); a prompt's first run starts at 0
        self.bad |= {slot for slot, toks, start in runs if start == 0 and POISON in toks}
        if self.bad & {slot for slot, toks, start in runs if start > 0}:
            raise RuntimeError("a row of this batch blew up")
        return super().step(runs)

    def clear(self, slot):
        self.bad.discard(slot)
        super().clear(slot)


def test_a_failing_pick_or_decode_fails_its_sequence_alone_and_frees_its_slot(gpt_export):
    model = tandem.export.load(gpt_export)
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for t in (1e-39, 1e-45, 5e-324, 1e-6):   # under GREEDY_BELOW: the argmax, never NaN
        assert _pick(torch, logits, {"temperature": t}, g) == 1
    with pytest.raises(PickError):
        _pick(torch, torch.full((4,), float("nan")), {"temperature": 0.7}, g)

    def pick(lg, req, gen):
        if req.get("poison_pick"):
            raise PickError("this one cannot be sampled")
        return _pick(torch, lg, req, gen)
    dec = Breaking(model, 3)
    s = Scheduler(dec, pick)
    reqs = {"a": {"prompt": [3, 4], "max_new_tokens": 6}, "b": {"prompt": [POISON, 1], "max_new_tokens": 6},
            "c": {"prompt": [5], "max_new_tokens": 6, "poison_pick": True},
            "d": {"prompt": [7, 2, 1], "max_new_tokens": 5, "temperature": 1e-39}}
    got = {}
    for rid, r in reqs.items():   # 3 slots, 4 requests: "d" waits for the slot a failed one frees
        got.update(s.add(rid, r))
    failed = {}
    while s.busy:
        got.update(s.step())
        failed.update(s.take_failed())
    assert sorted(failed) == ["b", "c"] and "RuntimeError" in failed["b"] and "PickError" in failed["c"]
    assert got == {k: greedy(model, reqs[k]["prompt"], reqs[k]["max_new_tokens"]) for k in ("a", "d")}
    assert sorted(s.free) == [0, 1, 2] and not s.live and not s.waiting
    assert s.drop_all() == []


@pytest.fixture(scope="module")
def poisoned_export(gpt_export, tmp_path_factory):
    """The test export, with token POISON's input embedding row NaN (a token the warm-up input does not
    hold): any sequence holding it has NaN logits, the others are untouched."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tandem.export import format as fmt
    from tandem.export.loader import read_config

    out = tmp_path_factory.mktemp("poisoned") / "export"
    shutil.copytree(gpt_export, out)
    assert POISON not in fmt.make_input(read_config(out)["example_input"]).flatten().tolist()
    sd = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    if cfg.get("tied", {}).get("head.weight") == "tok_emb.weight":   # untied: the output layer stays finite
        sd["head.weight"] = sd["tok_emb.weight"].clone()
        cfg["tied"] = {}
        (out / "config.json").write_text(json.dumps(cfg))
    sd["tok_emb.weight"][POISON] = float("nan")
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.slow   # a server of its own (front and replica processes)
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_poisoned_request_fails_alone_and_tiny_temperatures_are_answered(poisoned_export, gpt_export, tmp_path,
                                                                          batching):
    model = tandem.export.load(gpt_export)
    with Server(poisoned_export, tmp_path / "srv", "--batch-wait-ms", "200", "--max-batch", "8",
                "--batching", batching) as srv:
        bodies = [{"prompt": [3, 1], "max_new_tokens": 6, "temperature": 1e-39},
                  {"prompt": [POISON, 2], "max_new_tokens": 6},
                  {"prompt": [5, 4, 2], "max_new_tokens": 6, "temperature": 5e-324, "seed": 3},
                  {"prompt": [9], "max_new_tokens": 6, "temperature": 0.0}]
        with ThreadPoolExecutor(len(bodies)) as ex:   # sent together: one batch (--batch-wait-ms 200)
            rs = list(ex.map(lambda b: srv.client.post("/v1/generate", json=b), bodies))
        codes = [r.status_code for r in rs]
        assert codes == [200, 500, 200, 200], [r.text for r in rs]
        for b, r in zip(bodies, rs):
            if r.status_code == 200:
                assert r.json()["tokens"] == greedy(model, b["prompt"], 6)
        assert "request" in rs[1].json()["error"] and rs[1].json()["field"] == ""
        # OpenAI's route: a temperature of 1e-39 is greedy, answered
        c = srv.client.post("/v1/completions", json={"model": "gpt", "prompt": [3, 1], "max_tokens": 6,
                                                     "temperature": 1e-39})
        assert c.status_code == 200 and c.json()["choices"][0]["token_ids"] == greedy(model, [3, 1], 6), c.text
        # the replica that answered the poisoned request is the same one, still serving, no restart
        m = srv.metrics()
        assert m[("tandem_serve_replica_restarts_total", "")] == 0
        assert srv.client.post("/v1/generate", json={"prompt": [2], "max_new_tokens": 3}).status_code == 200
