"""Fault injection for the fault-tolerance tests (and for rehearsing a recovery by hand).

``TANDEM_FAULTS`` holds comma-separated faults, each ``kind:key=value:...``::

    sigkill:rank=1:step=7          rank 1 sends itself SIGKILL right after step 7
    sigkill:rank=0:save=6          rank 0 dies inside the save of step 6 (shards written, not published)
    sigkill:rank=1:async_save=6    rank 1 dies while its async write of step 6 is in flight
    sigkill:rank=0:publish=6       rank 0 dies while publishing step 6: hashed, not yet renamed
                                   (with async_save, in the background publish thread)
    sigstop:rank=1:step=5          rank 1 stops itself (SIGSTOP) after step 5: a hang
    hang:rank=1:step=5             rank 1 sleeps (running, out of any collective) after step 5;
                                   its peers wait for it inside the next collective
    exit:rank=1:step=3:code=3      rank 1 exits with code 3 after step 3
    sigterm:rank=1:step=35         rank 1 is told to stop after step 35, as torchrun or a scheduler
                                   would tell it (elastic.save_on_term: the group stops at a step)
    slow:rank=1:ms=40              rank 1 waits 40 ms on every batch it loads (a slow data path)

A fault fires on the first attempt only; add ``:attempt=2`` to fire on that restart only,
or ``:attempts=all`` to fire on every one (to exhaust --max-restarts). The signals are
real: the kernel kills or stops the process as the OOM killer or an operator would.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from tandem.core.contract import attempt as group_attempt  # the group's attempt: a joined node counts too

ENV = "TANDEM_FAULTS"


def parse(text: str) -> list[dict]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, *pairs = item.split(":")
        fault = {"kind": kind}
        for pair in pairs:
            k, _, v = pair.partition("=")
            fault[k] = v
        out.append(fault)
    return out


def _active() -> list[dict]:
    text = os.environ.get(ENV)
    if not text:  # the usual case, on the step loop's path: nothing to parse
        return []
    attempt = group_attempt()
    return [f for f in parse(text)
            if f.get("attempts") == "all" or attempt == int(f.get("attempt", 0))]


def point(where: str, *, step: int, rank: int) -> None:
    """Fire the faults registered for ``where`` ('step', 'save', 'async_save', 'publish') at this step on this rank."""
    for f in _active():
        if f.get(where) is None or int(f[where]) != step or int(f.get("rank", -1)) != rank:
            continue
        kind = f["kind"]
        print(f"tandem fault injection: {kind} on rank {rank} at {where} {step} "
              f"(thread {threading.current_thread().name})", flush=True)
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "hang":
            time.sleep(float(f.get("s", 3600)))
        elif kind == "exit":
            os._exit(int(f.get("code", 1)))


def slow_ms(rank: int) -> float:
    """Milliseconds this rank should wait per batch ('slow' faults)."""
    return sum(float(f.get("ms", 0)) for f in _active() if f["kind"] == "slow" and int(f.get("rank", -1)) == rank)


def delay(rank: int) -> None:
    ms = slow_ms(rank)
    if ms:
        time.sleep(ms / 1000)
