"""What the pool and its two batchers share: a queued request (Work), the handle on one replica
process (Replica), and the errors a request can end in (the frames a replica sends and reads are
messages.py's).

The static batcher (pool.py) and the continuous one (stream.py) both send Work to a Replica and read
its frames; the pool owns the queue and the replicas and hands each replica to one of them.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path


class QueueFull(Exception):
    pass


class ReplicaError(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


class RequestFailed(ReplicaError):
    """This request failed (a replica answered it with an error, or gave up on it), not the server: a
    500 naming its id, not retried; the requests around it are answered as usual."""

    def __init__(self, rid: str, why: str):
        super().__init__(f"request {rid} failed: {why}")
        self.rid = rid


@dataclass(eq=False)   # identity: the pool keeps the outstanding ones in a set
class Work:
    kind: str                 # "predict" | "generate"
    payload: object           # examples (an array [N, ...]), or one generate request
    size: int                 # batch slots it takes
    future: asyncio.Future
    t_enq: float = field(default_factory=time.monotonic)
    attempts: int = 0         # replicas that died holding it
    rid: str = field(default_factory=lambda: secrets.token_hex(6))   # in logs and a failed request's 500
    timeout_ms: int = 0       # 0: no deadline
    # per-token delivery (a generate request of the OpenAI routes, openai_api.Choice): the continuous
    # batcher calls sink.on_started() when a replica takes it, sink.on_tokens(tokens, at) as they are
    # decoded, and sink.on_lost() when its replica dies (True: it already streamed to its client, so it
    # fails instead of being retried); cancelling the future drops it from the replica at its next step
    sink: object = None

    def expired(self, now: float) -> bool:
        return self.timeout_ms > 0 and now > self.t_enq + self.timeout_ms / 1000


class Replica:
    def __init__(self, slot: int, proc: asyncio.subprocess.Process, log: Path):
        self.slot, self.proc, self.log, self.pid = slot, proc, log, proc.pid
        self.continuous, self.tp_pids = False, []
        self.holding = False   # counted in the pool's busy replicas (it holds work now)
        self.load = 0          # continuous batching: the slots its requests in flight take (least-loaded routing)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
