"""One replica process: load the export once, warm up, then answer batches read from stdin.

    python -m tandem.serve.replica EXPORT_DIR [--threads N]

Protocol (one JSON object per line; no pickle anywhere):
    replica -> front   {"ready": true, "pid": P, "warmup_s": S}            once, after the warm-up forward
    front -> replica   {"op": "predict", "inputs": [example, ...]}         examples already validated
                       {"op": "generate", "requests": [{"prompt", "max_new_tokens", "temperature",
                                                       "top_k", "seed"}, ...]}
    replica -> front   {"outputs": [...]} | {"error": "..."}                one line per batch
The protocol stream is the process's original stdout; anything else printing to stdout (a library's
message) goes to stderr instead, so it cannot corrupt a reply.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _protocol_stream():
    """The original stdout for replies; fd 1 (and sys.stdout) now point at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def predict(model, torch, inputs: list, dtype) -> list:
    x = torch.tensor(inputs, dtype=dtype)
    n = len(x)
    if n == 1:
        # CPU convolution takes another kernel for a batch of one, whose last bits differ from the same
        # example inside a larger batch; a zero row keeps every output independent of batch composition.
        x = torch.cat([x, torch.zeros_like(x)])
    with torch.no_grad():
        return model(x)[:n].tolist()


def generate(model, torch, reqs: list[dict]) -> list[list[int]]:
    """Whole requests batched together: each decode step runs one forward over every active sequence
    (right-padded; causal attention keeps padding out of earlier positions) and picks each row's next
    token from the logits at its own last position. No KV cache: each step recomputes the prefix."""
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


def _pick(torch, logits, req: dict, gen) -> int:
    temp = float(req.get("temperature", 0.0))
    if temp <= 0:
        return int(logits.argmax())
    k = int(req.get("top_k") or 0)
    if 0 < k < logits.numel():
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temp, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    out = _protocol_stream()
    import torch

    import tandem.export
    from tandem.export import format as fmt
    from tandem.export.loader import read_config

    torch.set_num_threads(max(1, args.threads))
    t0 = time.perf_counter()
    cfg = read_config(args.export)
    model = tandem.export.load(args.export, device="cpu")
    desc = cfg["example_input"]
    dtype = torch.long if desc["dtype"] == "int64" else torch.float32
    warm = fmt.make_input(desc)
    with torch.no_grad():
        y = model(warm)
    if not torch.isfinite(y.float()).all():
        raise SystemExit("warm-up forward gave non-finite outputs")
    out.write(json.dumps({"ready": True, "pid": os.getpid(), "warmup_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "predict":
                reply = {"outputs": predict(model, torch, msg["inputs"], dtype)}
            else:
                reply = {"outputs": generate(model, torch, msg["requests"])}
        except Exception as e:  # a bad batch answers an error; the replica stays up
            reply = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
