"""`--replicas MIN:MAX`: add a replica when the queue stays deep, remove one when replicas stay idle.

The policy is a plain object fed observations (time, queue depth, busy and live replicas); it holds no
clock and no I/O, so it is tested by feeding it a sequence of observations. The pool samples it every
``tick_s`` and acts on what it returns; every decision is printed with its reason, appended to
RUN_DIR/autoscale.jsonl, and counted in /metrics.

    up    the queue held more than ``up_queue`` requests at every sample for ``up_s`` seconds, fewer than
          MAX replicas run, and none is still loading (a loading replica is capacity on its way);
          or, with ``up_p99_ms`` set (--scale-up-p99-ms), the p99 of the requests answered in the last
          ``p99_window_s`` seconds was above it at every sample for ``up_s`` seconds (same conditions).
          The queue catches a backlog; the p99 catches replicas that keep up but too slowly (full
          batches, each slower), which the queue alone never shows while it stays shallow.
    down  the queue was empty and at least one replica idle at every sample for ``down_s`` seconds, and
          more than MIN run
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.core.errors import ConfigError


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int
    max_replicas: int
    up_queue: int = 32        # queue depth that counts as "deep"
    up_s: float = 2.0         # how long it must stay deep
    down_s: float = 30.0      # how long replicas must stay idle
    tick_s: float = 0.25      # how often the pool samples
    up_p99_ms: float = 0.0    # recent p99 that counts as "slow" (0: off)
    p99_window_s: float = 5.0  # the recent p99 is over requests answered this long ago at most


def parse_replicas(text: str) -> tuple[int, int]:
    """``N`` (fixed) or ``MIN:MAX`` (autoscaled) -> (MIN, MAX)."""
    lo, sep, hi = str(text).partition(":")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ConfigError("expected N or MIN:MAX", field="--replicas", value=text,
                          fix="give e.g. --replicas 2 or --replicas 1:4") from None
    if a < 1 or b < a:
        raise ConfigError("must be at least 1" if a < 1 else "MIN is more than MAX", field="--replicas",
                          value=text, fix="give e.g. --replicas 2 or --replicas 1:4")
    return a, b


@dataclass(frozen=True)
class Decision:
    direction: str   # "up" | "down"
    before: int
    after: int
    reason: str
    signal: str = "queue"   # "queue" | "p99" (up), "idle" (down)


class Scaler:
    def __init__(self, policy: ScalePolicy):
        self.p = policy
        self._deep_since: float | None = None
        self._idle_since: float | None = None
        self._slow_since: float | None = None

    def observe(self, now: float, depth: int, busy: int, live: int, loading: int,
                p99_ms: float | None = None) -> Decision | None:
        """One sample: ``live`` replicas serving (``busy`` of them on a batch), ``loading`` starting;
        ``p99_ms`` of the requests answered in the last ``p99_window_s`` (None: none answered)."""
        p, n = self.p, live + loading
        deep = depth > p.up_queue
        # while a replica loads, the p99 still describes the smaller pool: the period starts once it serves
        slow = p.up_p99_ms > 0 and p99_ms is not None and p99_ms > p.up_p99_ms and loading == 0
        idle = depth == 0 and busy < live and loading == 0
        self._deep_since = (self._deep_since if self._deep_since is not None else now) if deep else None
        self._slow_since = (self._slow_since if self._slow_since is not None else now) if slow else None
        self._idle_since = (self._idle_since if self._idle_since is not None else now) if idle else None
        if n < p.max_replicas and loading == 0:
            if deep and now - self._deep_since >= p.up_s:
                self._deep_since = self._slow_since = None   # the next one needs another full period
                return Decision("up", n, n + 1, f"queue above {p.up_queue} for {p.up_s:g} s (depth {depth})")
            if slow and now - self._slow_since >= p.up_s:
                self._deep_since = self._slow_since = None
                return Decision("up", n, n + 1, f"p99 above {p.up_p99_ms:g} ms for {p.up_s:g} s "
                                                f"(p99 {p99_ms:.0f} ms over the last {p.p99_window_s:g} s)", "p99")
        if idle and now - self._idle_since >= p.down_s and n > p.min_replicas:
            self._idle_since = None
            return Decision("down", n, n - 1, f"queue empty and {live - busy} of {live} replica(s) idle for "
                                              f"{p.down_s:g} s", "idle")
        return None


def recent_p99_ms(recent: deque, since: float) -> float | None:
    """p99 in ms of ``recent`` (answered at, seconds taken) entries answered at ``since`` or later; None if
    none were. Entries a minute older than ``since`` are dropped (older than any window)."""
    while recent and recent[0][0] < since - 60:
        recent.popleft()
    lat = sorted(x for t, x in recent if t >= since)
    return 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
