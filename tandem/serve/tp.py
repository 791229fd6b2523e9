"""A tensor-parallel replica: one model over N processes on one torch.distributed group (gloo here,
NCCL where there are GPUs), each holding its ``tp-R-of-N`` slices of the export (tandem/export/tp.py).

Rank 0 is the replica process the pool talks to (replica.py --tp N). It starts ranks 1..N-1 the way
torchrun does (MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE in the environment, ``env://``), and owns
the scheduler: for every decoder call (a step, a cleared slot, a plain forward) it first broadcasts the
call to the group as a small JSON message (length, then bytes: no pickle), then every rank runs the
same continuous.Decoder on its slices, with ``TPComm`` doing the collectives of the Megatron split:

    token and position embeddings   vocabulary-parallel: look up the rows this rank owns, zeros
                                    elsewhere, all-reduce (sum)
    attention out, MLP second       row-parallel: partial products all-reduced, the replicated bias
                                    added once after
    output layer                    column-parallel over the vocabulary: all-gather the pieces

Every rank ends with the same full logits; rank 0 picks and answers. One rank failing is the whole
replica failing: rank 0 exits when any other rank exits (a watcher thread), the others die with rank
0 (PR_SET_PDEATHSIG, and their next collective fails), and the pool restarts the replica and retries
its requests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tandem.core.teardown import close_process_group
from tandem.serve.continuous import Decoder

TIMEOUT = timedelta(days=365)   # an idle replica waits in a broadcast for its next call: no timeout (a dead rank is seen by _watch)


class TPComm:
    def __init__(self, model, cfg: dict, rank: int, world: int):
        spec = cfg["model"]
        self.rank, self.world, self.vocab, self.seq = rank, world, int(spec["vocab"]), int(spec["seq"])
        # torch.chunk's pieces: rank r owns rows [r * ceil(n / world), ...)
        self._lo = {id(model.tok_emb): rank * -(-self.vocab // world), id(model.pos_emb): rank * -(-self.seq // world)}

    def embed(self, emb, idx):
        n = emb.weight.shape[0]
        local = idx - self._lo[id(emb)]
        inside = (local >= 0) & (local < n)
        out = F.embedding(local.clamp(0, max(n - 1, 0)), emb.weight) * inside.unsqueeze(-1).to(emb.weight.dtype)
        dist.all_reduce(out)
        return out

    def row(self, lin, x):
        y = F.linear(x, lin.weight)
        dist.all_reduce(y)
        return y if lin.bias is None else y + lin.bias

    def head(self, model, h):
        y = F.linear(h, model.head.weight)
        size = -(-self.vocab // self.world)
        if y.shape[-1] < size:  # the last pieces may be shorter: pad so every rank sends the same shape
            y = F.pad(y, (0, size - y.shape[-1]))
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, dim=-1)[..., :self.vocab]


class TPDecoder(Decoder):
    """Rank 0's decoder: each call is broadcast to the group before it runs here."""

    def step(self, runs):
        _bcast({"op": "step", "runs": runs})
        return super().step(runs)

    def clear(self, slot):
        _bcast({"op": "clear", "slot": slot})
        return super().clear(slot)

    def logits(self, tokens):
        _bcast({"op": "logits", "tokens": tokens.tolist()})
        return super().logits(tokens)


def _bcast(msg: dict | None) -> dict:
    """Rank 0 sends ``msg``; every other rank passes None and gets it."""
    if msg is not None:
        data = torch.frombuffer(bytearray(json.dumps(msg).encode()), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, 0)
    if msg is None:
        data = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(data, 0)
    return msg if msg is not None else json.loads(bytes(data.numpy()).decode())


class Group:
    """Rank 0's handle on the tp group: the other ranks' processes and the process group."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.pids = [p.pid for p in procs]

    @classmethod
    def start(cls, procs: list[subprocess.Popen], env: dict) -> "Group":
        """Rank 0 joins the group whose other ranks ``spawn`` started."""
        group = cls(procs)
        for p in procs:
            threading.Thread(target=group._watch, args=(p,), daemon=True).start()
        os.environ.update({**env, "RANK": "0"})
        dist.init_process_group("gloo", init_method="env://", rank=0, world_size=len(procs) + 1, timeout=TIMEOUT)
        return group

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not getattr(self, "closing", False):
            print(f"tp rank (pid {proc.pid}) exited with {code}: the replica goes down with it", file=sys.stderr,
                  flush=True)
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
            os._exit(1)

    def decoder(self, model, cfg: dict, slots: int) -> TPDecoder:
        return TPDecoder(model, slots, TPComm(model, cfg, 0, len(self.procs) + 1))

    def close(self) -> None:
        self.closing = True
        try:
            _bcast({"op": "stop"})
            close_process_group(True)   # the ranks meet, then each closes (teardown.py)
        finally:
            for p in self.procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            close_process_group(False)   # if the stop failed: the ranks are gone, close at once


def worker(argv: list[str] | None = None) -> None:
    """Ranks 1..N-1: load this rank's slices, then run whatever rank 0 broadcasts, until "stop"."""
    import argparse

    import tandem.export
    from tandem.export.loader import read_config

    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--slots", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=TIMEOUT)
    cfg = read_config(args.export)
    model = tandem.export.load(args.export, device="cpu", tp_rank=rank)
    dec = Decoder(model, args.slots, TPComm(model, cfg, rank, world))
    while (msg := _bcast(None))["op"] != "stop":
        if msg["op"] == "step":
            dec.step([tuple(r) for r in msg["runs"]])
        elif msg["op"] == "clear":
            dec.clear(msg["slot"])
        else:
            dec.logits(torch.tensor(msg["tokens"]))
    close_process_group(True)   # meet rank 0, let gloo's threads drain before the interpreter exits (teardown.py)


if __name__ == "__main__":
    worker()
