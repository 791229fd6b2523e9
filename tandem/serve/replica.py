"""One replica process: load the export once, warm up, then answer batches read from stdin.

    python -m tandem.serve.replica EXPORT_DIR [--threads N]

Protocol (frames: one JSON header line, then the header's "nbytes" raw bytes; no pickle anywhere; each
frame is a typed message of messages.py, named on the right):
    replica -> front   {"ready": true, "pid": P, "warmup_s": S}            Ready, once, after the warm-up
    front -> replica   {"op": "predict", "shape": [N, ...], "dtype": D, "nbytes": B} + the examples'
                                                                           raw little-endian bytes (validated)
                                                                           (Predict)
                       {"op": "generate", "requests": [{"prompt", "max_new_tokens", "temperature",
                                                       "top_k", "seed"}, ...]}      (Generate)
    replica -> front   {"shape", "dtype": "float32", "nbytes"} + raw outputs (predict; Array)
                       {"outputs": [[tok, ...] | null, ...], "errors": {"i": why}} (generate; Outputs: a
                       request that failed alone is null, its reason by index) | {"error": "..."} (Error)
Continuous batching (a GPT with a KV cache, --slots S; continuous.py): requests carry an "id" and are
answered one by one, in the order they finish, not the order sent:
    front -> replica   {"op": "join", "id": K, "request": {...}}     joins the running batch at the next step (Join)
                       {"op": "predict", "id": K, "shape", "dtype", "nbytes"} + bytes   run between steps
    replica -> front   {"id": K, "outputs": [tok, ...]} | {"id": K, "shape", ...} + bytes | {"id": K, "error"}
A join with "stream": true also gets {"id": K, "tokens": [new, ...], "at": N} after each step that
decoded some (N tokens came before); {"op": "cancel", "id": K} drops K before the next step (answered
{"id": K, "outputs": [...], "cancelled": true}, or nothing if K had already finished) (Tokens, Cancel).
With --heartbeat-s H, every H seconds, busy or idle, {"held": {K: tokens so far, ...}} (Held): the front
tells a hung replica (no frame) from a request lost inside a live one (its count stays put).
A reader thread parses frames while the main thread decodes, so a request sent mid-generation joins
at the next step instead of waiting for the batch to drain.
Arrays travel as bytes: as JSON lists, encoding and parsing a batch cost more than the model's
forward (docs/bench.md, "Measurements behind the code's choices").
The protocol stream is the process's original stdout; anything else printing to stdout (a library's
message) goes to stderr instead, so it cannot corrupt a reply.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time

import numpy as np

from tandem.serve.faults import Faults
from tandem.serve import messages as M
from tandem.serve.messages import GREEDY_BELOW

DTYPES = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}
FAULTS = Faults()


def _protocol_stream():
    """The original stdout for replies; fd 1 (and sys.stdout) now point at stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def predict(model, torch, x):
    n = len(x)
    if n == 1:
        # CPU convolution takes another kernel for a batch of one, whose last bits differ from the same
        # example inside a larger batch; a zero row keeps every output independent of batch composition.
        x = torch.cat([x, torch.zeros_like(x)])
    with torch.no_grad():
        return model(x)[:n].float().contiguous()


def generate(model, torch, reqs: list[dict]) -> list[list[int]]:
    """Whole requests batched together: each decode step runs one forward over every active sequence
    (right-padded; causal attention keeps padding out of earlier positions) and picks each row's next
    token from the logits at its own last position. No KV cache: each step recomputes the prefix (models
    kvcache.py does not know; tandem's GPT takes generate_cached)."""
    seqs = [list(r["prompt"]) for r in reqs]
    gens = [torch.Generator().manual_seed(int(r.get("seed", 0))) for r in reqs]
    out: list[list[int]] = [[] for _ in reqs]
    active = [i for i, r in enumerate(reqs) if r["max_new_tokens"] > 0]
    with torch.no_grad():
        while active:
            width = max(len(seqs[i]) for i in active)
            x = torch.zeros(len(active), width, dtype=torch.long)
            for row, i in enumerate(active):
                x[row, :len(seqs[i])] = torch.tensor(seqs[i])
            logits = model(x)
            for row, i in enumerate(active):
                tok = _pick(torch, logits[row, len(seqs[i]) - 1].float(), reqs[i], gens[i])
                seqs[i].append(tok)
                out[i].append(tok)
            active = [i for i in active if len(out[i]) < reqs[i]["max_new_tokens"]]
    return out


def generate_cached(model, torch, reqs: list[dict]) -> list[list[int]]:
    """The same tokens as ``generate`` (same picks, same per-request generators), decoded with a KV
    cache (kvcache.py): faster, as each step no longer recomputes the prefix (docs/bench.md)."""
    from tandem.serve import kvcache

    gens = [torch.Generator().manual_seed(int(r.get("seed", 0))) for r in reqs]
    return kvcache.generate(model, reqs, lambda logits, i: _pick(torch, logits, reqs[i], gens[i]))


class PickError(ValueError):
    """A sequence's next token could not be chosen (its logits hold no usable probability): that
    sequence fails alone, its neighbours in the batch go on."""


def _pick(torch, logits, req: dict, gen) -> int:
    temp = float(req.get("temperature", 0.0))
    if not temp > GREEDY_BELOW:   # greedy; `not >` also catches a NaN that slipped through
        if not torch.isfinite(logits).any():
            raise PickError("the model gave no finite logit for this sequence")
        return int(logits.argmax())
    k = int(req.get("top_k") or 0)
    if 0 < k < logits.numel():
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # the largest logit is 0 before the division, so a small temperature sends the others to -inf
    # (probability 0), never to inf - inf (NaN)
    probs = torch.softmax((logits - logits.max()) / temp, dim=-1)
    p = float(req.get("top_p", 1.0))
    if 0 < p < 1:   # nucleus: the most likely tokens whose probabilities first reach p
        sp, order = torch.sort(probs, descending=True)
        sp[(torch.cumsum(sp, 0) - sp) >= p] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sp)
    if not (torch.isfinite(probs).all() and float(probs.sum()) > 0):
        raise PickError(f"sampling at temperature {temp:g} gave no valid probabilities (non-finite logits?)")
    return int(torch.multinomial(probs, 1, generator=gen))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--slots", type=int, default=0, help="continuous batching with this many KV-cache slots")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: this process is rank 0")
    ap.add_argument("--step-tokens", type=int, default=256,
                    help="continuous batching: tokens one step feeds at most (decoding rows, then prompt chunks)")
    ap.add_argument("--heartbeat-s", type=float, default=0.0,
                    help="continuous batching: every this many seconds, busy or idle, a {held} frame")
    args = ap.parse_args(argv)
    out = _protocol_stream()
    ranks = None
    if args.tp > 1:  # the other tp ranks start first, in parallel with this process's imports
        from tandem.serve.tp_spawn import spawn

        ranks = spawn(args.export, args.tp, args.threads, max(1, args.slots))
    import torch

    import tandem.export
    from tandem.export import format as fmt
    from tandem.serve import kvcache
    from tandem.export.loader import read_config

    torch.set_num_threads(max(1, args.threads))
    t0 = time.perf_counter()
    cfg = read_config(args.export)
    group = None
    if args.tp > 1:  # rank 0 of a tensor-parallel replica: start the other ranks, then load rank 0's slices
        from tandem.serve import tp

        group = tp.Group.start(*ranks)
        model = tandem.export.load(args.export, device="cpu", tp_rank=0)
    else:
        model = tandem.export.load(args.export, device="cpu")
    served = ReplicaModel(model, cfg, max(1, args.slots), group, step_tokens=args.step_tokens)
    warm = fmt.make_input(cfg["example_input"])
    y = served.forward(torch, warm)
    if not torch.isfinite(y.float()).all():
        raise SystemExit("warm-up forward gave non-finite outputs")
    cached = group is not None or kvcache.supports(model)  # tandem's GPT: decode with a KV cache
    _send(out, M.Ready(pid=os.getpid(), warmup_s=time.perf_counter() - t0, kv_cache=cached,
                       continuous=cached and args.slots > 0, tp=args.tp, tp_pids=group.pids if group else []))
    frames: queue.Queue = queue.Queue()
    threading.Thread(target=_read_frames, args=(sys.stdin.buffer, frames), daemon=True).start()
    sched = served.scheduler(torch) if cached else None
    streamed: dict = {}   # id -> tokens already sent, of the requests that stream ({"stream": true})
    beat = args.heartbeat_s if cached and args.slots > 0 else 0.0
    last_beat = time.monotonic()
    while True:
        try:  # idle: block for the next frame (or the next heartbeat); decoding: take whatever arrived, then step
            item = frames.get(block=not (sched and sched.busy), timeout=beat or None)
        except queue.Empty:
            item = ()
        if beat and time.monotonic() - last_beat >= beat:
            # alive, and how far each request it holds has got: the front tells a hung replica (no frame
            # at all) from one request lost inside a busy one (no new token for it)
            _send(out, M.Held(sched.held()))
            last_beat = time.monotonic()
        items = [item] if item != () else []
        while True:
            try:
                items.append(frames.get_nowait())
            except queue.Empty:
                break
        if None in items:  # stdin closed: the front is stopping this replica
            break
        for msg in items:
            if isinstance(msg, M.Cancel):   # dropped before the next step: its slot is free for that step
                for rid, toks in sched.cancel(msg.id) if sched else []:
                    _send(out, M.Outputs(toks, id=rid, cancelled=True))
                streamed.pop(msg.id, None)
                continue
            if isinstance(msg, M.Join) and msg.stream and sched:
                streamed[msg.id] = 0
            _handle(out, served, sched, torch, msg)
        if sched and sched.busy:
            try:
                done = sched.step()
            except Exception as e:  # a failed step fails the sequences in it; the replica stays up
                _fatal_under_tp(served, e)
                done = []
                for rid in sched.drop_all():
                    _send(out, M.Error(f"{type(e).__name__}: {str(e)[:300]}", id=rid))
            for rid, toks in done:
                streamed.pop(rid, None)
                _send(out, M.Outputs(toks, id=rid))
            for rid, why in sched.take_failed():   # a sequence that failed alone: its neighbours went on
                streamed.pop(rid, None)
                _send(out, M.Error(why, id=rid))
            if streamed:
                streamed = _stream_tokens(out, sched, streamed)
    if group:
        group.close()


class ReplicaModel:
    """The model on this process (or, with a tp group, its rank-0 slices driving every rank)."""

    def __init__(self, model, cfg: dict, slots: int, group=None, step_tokens: int = 256):
        self.model, self.cfg, self.slots, self.group = model, cfg, slots, group
        self.step_tokens = step_tokens
        self.decoder = None
        if group is not None:
            self.decoder = group.decoder(model, cfg, slots)
        else:
            from tandem.serve import kvcache

            if kvcache.supports(model):
                from tandem.serve.continuous import Decoder

                self.decoder = Decoder(model, slots)

    def forward(self, torch, x):
        if self.group is not None:
            return self.decoder.logits(x)
        with torch.no_grad():
            return self.model(x)

    def predict(self, torch, x):
        if self.group is not None:
            return self.decoder.logits(x).float().contiguous()
        return predict(self.model, torch, x)

    def scheduler(self, torch):
        from tandem.serve.continuous import Scheduler

        return Scheduler(self.decoder, lambda logits, req, gen: _pick(torch, logits, req, gen),
                         isolate=self.group is None, step_tokens=self.step_tokens)

    def generate(self, torch, reqs: list[dict]) -> list[list[int]]:
        if self.group is not None:
            return self.scheduler(torch).run(reqs)
        if self.decoder is not None:
            return generate_cached(self.model, torch, reqs)
        return generate(self.model, torch, reqs)


def _handle(out, served: ReplicaModel, sched, torch, msg: M.Request) -> None:
    rid = getattr(msg, "id", None)
    try:
        if isinstance(msg, M.Predict):
            x = np.frombuffer(msg.raw, dtype=DTYPES[msg.dtype]).reshape(msg.shape)
            y = served.predict(torch, torch.from_numpy(x.copy()))
            _send(out, M.Array(list(y.shape), id=rid, raw=y.numpy().astype("<f4").tobytes()))
        elif isinstance(msg, M.Join):
            if FAULTS.lose(msg.request):   # TANDEM_SERVE_FAULTS (faults.py): tests of the front's watchdog
                return
            for k, toks in sched.add(msg.id, msg.request):
                _send(out, M.Outputs(toks, id=k))
        else:
            outs, errors = _generate_each(served, torch, msg.requests)
            _send(out, M.Outputs(outs, errors=errors or None))
    except Exception as e:  # a bad request answers an error; the replica stays up
        _fatal_under_tp(served, e)
        _send(out, M.Error(f"{type(e).__name__}: {str(e)[:300]}", id=rid))


def _generate_each(served: ReplicaModel, torch, reqs: list[dict]) -> tuple[list, dict]:
    """A static batch's outputs; if the batch fails, each request alone, so that the one that breaks it
    fails alone: (outputs, None for a failed one), {index: reason}."""
    try:
        return served.generate(torch, reqs), {}
    except Exception as e:
        _fatal_under_tp(served, e)
        if len(reqs) == 1:
            return [None], {"0": f"{type(e).__name__}: {str(e)[:300]}"}
    outs, errors = [], {}
    for i, r in enumerate(reqs):
        try:
            outs.append(served.generate(torch, [r])[0])
        except Exception as e:
            outs.append(None)
            errors[str(i)] = f"{type(e).__name__}: {str(e)[:300]}"
    return outs, errors


def _stream_tokens(out, sched, streamed: dict) -> dict:
    """Each streamed sequence's tokens decoded since the last frame, as {"id", "tokens", "at"} (``at``: how
    many came before); the ids still running."""
    seqs = {s.rid: s for s in sched.live.values()}
    for rid, n in streamed.items():
        s = seqs.get(rid)
        if s is not None and len(s.out) > n:
            _send(out, M.Tokens(rid, s.out[n:], n))
            streamed[rid] = len(s.out)
    waiting = {s.rid for s in sched.waiting}
    return {rid: n for rid, n in streamed.items() if rid in seqs or rid in waiting}


def _fatal_under_tp(served: ReplicaModel, e: Exception) -> None:
    """On a tp replica a failure is a rank gone (a collective failed) or ranks out of step: either way
    the group is unusable, so exit and let the pool restart the replica and retry the requests,
    instead of answering them with an error."""
    if served.group is not None:
        print(f"tp replica: {type(e).__name__}: {str(e)[:300]}; exiting", file=sys.stderr, flush=True)
        os._exit(1)


def _read_frames(inp, frames: queue.Queue) -> None:
    """Requests from the front (messages.py); None at end of input."""
    try:
        while line := inp.readline():
            hdr = json.loads(line)
            frames.put(M.parse_request(hdr, inp.read(hdr.get("nbytes", 0))))
    finally:
        frames.put(None)


def _send(out, msg: M.Reply) -> None:
    out.write(M.encode(msg))
    out.flush()


if __name__ == "__main__":
    main()
