"""Each rank's progress file, read by the agent's watchdog and by the tests.

``run_dir/heartbeat/rank-<R>.json``, replaced atomically at every beat::

    {"rank": 1, "local_rank": 1, "pid": 4242, "ppid": 4200, "host": "vm", "attempt": 0,
     "run_id": "...", "step": 17, "phase": "step", "time": 1764400000.12}

``phase`` is where the rank was: ``start`` (before the first step), ``sync`` (about to
run the backward that all-reduces the gradients: the collective it would wait in),
``step`` (a step finished), and, not judged by the watchdog, ``save``, ``eval``, ``done``
(after the last step). ``ppid`` is the torchrun agent that
spawned the worker: each agent's watchdog acts only on its own workers.

On SIGUSR1 the rank writes every thread's Python stack (faulthandler) to
``run_dir/watchdog/stacks-rank-<R>.attempt<k>.txt``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import time
from pathlib import Path


def stack_file(run_dir: Path, rank: int, attempt: int) -> Path:
    return Path(run_dir) / "watchdog" / f"stacks-rank-{rank}.attempt{attempt}.txt"


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, local_rank: int) -> None:
        self.dir = Path(run_dir) / "heartbeat"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank-{rank}.json"
        self._tmp = self.dir / f".rank-{rank}.json.tmp"
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.base = {"rank": rank, "local_rank": local_rank, "pid": os.getpid(), "ppid": os.getppid(),
                     "host": socket.gethostname(), "attempt": attempt,
                     "run_id": os.environ.get("TORCHELASTIC_RUN_ID", "")}
        stacks = stack_file(run_dir, rank, attempt)
        stacks.parent.mkdir(parents=True, exist_ok=True)
        self._stacks = open(stacks, "w")
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        self.step = 0

    def beat(self, step: int, phase: str = "step") -> None:
        self.step = step
        self._tmp.write_text(json.dumps({**self.base, "step": step, "phase": phase, "time": time.time()}))
        os.replace(self._tmp, self.path)


def read_all(run_dir: Path) -> list[dict]:
    out = []
    for p in sorted((Path(run_dir) / "heartbeat").glob("rank-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (json.JSONDecodeError, FileNotFoundError):
            pass
    return out
