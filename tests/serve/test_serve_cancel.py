"""Cancelling a sequence (its client went away, or the front saw a stop sequence), counted in decode
steps: in process on the scheduler, and over the replica's own stdin/stdout protocol."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tandem.export
from serve.serve_helpers import ROOT, greedy
from tandem.serve.continuous import Decoder, Scheduler
from tandem.serve.replica import _pick


def test_a_cancelled_sequence_frees_its_slot_for_the_next_step(gpt_export):
    model = tandem.export.load(gpt_export)
    s = Scheduler(Decoder(model, 1), lambda logits, req, gen: _pick(torch, logits, req, gen))
    s.add("a", {"prompt": [3], "max_new_tokens": 16, "temperature": 0.0})
    for _ in range(3):
        assert s.step() == []                   # prefill, then 2 decode steps
    assert s.steps == 2 and not s.free
    s.add("b", {"prompt": [5, 1], "max_new_tokens": 2, "temperature": 0.0})
    (rid, toks), = s.cancel("a")
    assert rid == "a" and toks == greedy(model, [3], 3) and s.free == [0]
    assert s.step() == [] and [q.rid for q in s.live.values()] == ["b"]   # b takes the slot at once
    assert s.steps == 2                         # nothing decoded "a" after its cancel
    assert s.step() == [("b", greedy(model, [5, 1], 2))] and s.cancel("a") == [] and s.cancel("zz") == []
    s.add("c", {"prompt": [1], "max_new_tokens": 4, "temperature": 0.0})
    assert s.cancel("c") == [("c", [])] and not s.busy   # still waiting: dropped before its prefill


@pytest.mark.slow   # a replica process: its torch import and warm-up
def test_replica_streams_tokens_and_answers_a_cancel(gpt_export):
    """A streamed join gets {"tokens", "at"} frames whose concatenation is its tokens; a cancel is
    answered with "cancelled" and the tokens decoded by then, and no frame for it follows."""
    p = subprocess.Popen([sys.executable, "-m", "tandem.serve.replica", str(gpt_export), "--slots", "2"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)

    def send(msg):
        p.stdin.write(json.dumps(msg).encode() + b"\n")
        p.stdin.flush()

    def read():
        hdr = json.loads(p.stdout.readline())
        p.stdout.read(hdr.get("nbytes", 0))
        return hdr
    try:
        assert read()["ready"]
        send({"op": "join", "id": 1, "stream": True, "request": {"prompt": [2, 9], "max_new_tokens": 12}})
        got, frames = [], []
        while True:
            f = read()
            if "outputs" in f:
                break
            assert f["id"] == 1 and f["at"] == len(got)
            got += f["tokens"]
            frames.append(f)
        assert f["outputs"] == got + f["outputs"][len(got):] and len(f["outputs"]) == 12
        assert len(frames) >= 2   # token by token, not one frame at the end
        # the cancel right behind the join (one write): it is read before the 16 steps are done
        p.stdin.write(json.dumps({"op": "join", "id": 2, "stream": True,
                                  "request": {"prompt": [4], "max_new_tokens": 16}}).encode() + b"\n"
                      + json.dumps({"op": "cancel", "id": 2}).encode() + b"\n")
        p.stdin.flush()
        while "tokens" in (f := read()):
            assert f["id"] == 2
        assert f["id"] == 2 and f["cancelled"] and len(f["outputs"]) < 16
        send({"op": "join", "id": 3, "request": {"prompt": [4], "max_new_tokens": 2}})
        assert read() == {"id": 3, "outputs": greedy(tandem.export.load(gpt_export), [4], 2), "nbytes": 0}
    finally:
        p.stdin.close()
        p.wait(30)
