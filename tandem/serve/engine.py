"""The two interfaces of serving, declared: what the HTTP front needs of an engine (``Engine``: the
local pool of replica processes, pool.Pool, and Ray Serve, ray_engine.RayPool, both implement it),
and what the continuous batcher (stream.py) takes from the pool that owns the queue (``Feed``:
pool.Pool). Each side imports this module, not the other: no import cycle, and an engine's surface
is written down once (tests/serve/test_serve_engine.py checks both engines against it).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:   # types only (pool.PoolOptions is named, not imported: pool.py imports this module)
    from tandem.serve.metrics import Metrics
    from tandem.serve.work import Replica, Work


class Engine(Protocol):
    """An engine behind the front: requests in, answers (or the errors of work.py) out."""

    o: "PoolOptions"   # pool.PoolOptions: the options it was built with (max_batch, max_queue, hang_s, ...)
    active: int        # replicas it runs (or is scaling to)
    ready_count: int   # replicas serving now
    streams: bool      # submit(..., sink=) delivers tokens step by step (else all at the end)

    async def start(self) -> None:
        """Load every replica; raise ReplicaError when one cannot start."""

    async def close(self) -> None:
        """Stop every replica; fail what is still waiting."""

    async def submit(self, kind: str, payload, size: int, timeout_ms: int = 0, sink=None):
        """Run one request ("predict": an array of ``size`` examples; "generate": one request dict):
        its outputs, or QueueFull (429), DeadlineExceeded (504), RequestFailed (500), ReplicaError (503)."""

    def ready_pids(self) -> list[int]:
        """The pids of the replicas serving now (for the start-up line)."""

    def drain(self) -> None:
        """SIGTERM: restart and add no replica from now on."""

    def abort(self, why: str) -> None:
        """The drain ran out: every request not yet answered fails with ReplicaError(why) (503)."""


class Feed(Protocol):
    """What the continuous batcher takes from the pool: its queue (under ``cond``), options, metrics and
    log, and four calls back."""

    o: "PoolOptions"
    m: Metrics
    queue: deque[Work]
    cond: asyncio.Condition
    closing: bool

    def say(self, msg: str) -> None:
        """One line in the front's log."""

    def retired(self, slot: int) -> bool:
        """The replica slot was scaled down: finish what it holds, take no more."""

    async def requeue(self, works: list[Work]) -> None:
        """Work a dead replica held: back to the head of the queue, or failed (500) after MAX_DEATHS."""

    def hold(self, rep: Replica, now: bool) -> None:
        """``rep`` holds work (True) or none (False): the autoscaler's busy count."""

    def least_loaded(self, rep: Replica) -> bool:
        """``rep`` may take the next queued request: no other serving replica with a free slot holds
        fewer requests in flight (least-loaded routing; ties take)."""
