"""Each rank's progress file, written by the worker, read by the agent's watchdog (part of the
worker/agent contract, see contract.py).

``run_dir/heartbeat/rank-<R>.json``, rewritten in place at every beat::

    {"rank": 1, "local_rank": 1, "pid": 4242, "ppid": 4200, "host": "vm", "attempt": 0,
     "run_id": "...", "step": 17, "phase": "step", "time": 1764400000.12, "step_time": 1764400000.10}

followed by a line with the CRC-32 of the JSON text (8 hex digits). ``time`` is the last
beat, ``step_time`` when ``step`` finished (the last progress).

The file is a fixed-size page the rank keeps open and rewrites in place with one
``pwrite`` (microseconds), where writing a new file and renaming it cost milliseconds under
load, twice a step (docs/bench.md). The page's blocks are written once when the file is made, so a
beat never allocates disk: on a full disk the rank fails at start with a clear OSError,
never later (a memory-mapped page over a sparse file dies of SIGBUS instead). The page
cache makes the bytes visible at once to readers on the same host (the agent's watchdog
judges only its own workers) and keeps them when the rank is killed; on shared storage,
other hosts see them when the kernel writes the page back. A reader can catch a beat
half-copied, and that can still parse as JSON (digits of the old text shifted into the
new), hence the checksum: ``read`` accepts a page only when it matches, and reads again
otherwise.

``phase`` is where the rank was: ``start`` (before the first step), ``sync`` (about to
run the backward that all-reduces the gradients: the collective it would wait in),
``step`` (a step finished), and, not judged by the watchdog, ``save``, ``eval``, ``done``
(after the last step). ``ppid`` is the torchrun agent that
spawned the worker: each agent's watchdog acts only on its own workers.

On SIGUSR1 the rank writes every thread's Python stack (faulthandler) to
``run_dir/watchdog/stacks-rank-<R>.attempt<k>.txt``. On SIGUSR2 its main thread holds still
for ``HOLD_S`` seconds: the watchdog sends it to a stopped rank before continuing it only to
read its flight recorder, which would otherwise show the collectives the rank entered in
the moments after SIGCONT, not where it stopped (then the watchdog kills it). Best effort:
a rank stopped inside C++ (a backward) runs on until it is back in Python.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import threading
import time
import zlib
from pathlib import Path

from tandem.core import rundir
from tandem.core.contract import attempt as group_attempt


def stack_file(run_dir: Path, rank: int, attempt: int) -> Path:
    return Path(run_dir) / rundir.WATCHDOG / f"stacks-rank-{rank}.attempt{attempt}.txt"


SIZE = 1024  # bytes of a heartbeat file: room for any host name and run id
HOLD_S = 10.0


def _hold(signum, frame) -> None:
    time.sleep(HOLD_S)  # see the module docstring: SIGUSR2 from the watchdog


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, local_rank: int) -> None:
        self.dir = Path(run_dir) / rundir.HEARTBEAT
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank-{rank}.json"
        attempt = group_attempt()  # the group's: a join counts too
        self.base = {"rank": rank, "local_rank": local_rank, "pid": os.getpid(), "ppid": os.getppid(),
                     "host": socket.gethostname()[:200], "attempt": attempt,
                     "run_id": os.environ.get("TORCHELASTIC_RUN_ID", "")[:200]}
        stacks = stack_file(run_dir, rank, attempt)
        stacks.parent.mkdir(parents=True, exist_ok=True)
        self._stacks = open(stacks, "w")
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGUSR2, _hold)
        self.step, self.step_time = 0, time.time()
        # The previous attempt's last beat stays readable until this rank's first beat.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(self._fd).st_size != SIZE:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, b" " * SIZE, 0)  # real blocks, not a hole: no allocation at a beat
        except OSError:
            os.close(self._fd)
            raise

    def beat(self, step: int, phase: str = "step") -> None:
        now = time.time()
        if phase == "step":
            self.step_time = now
        self.step = step
        text = json.dumps({**self.base, "step": step, "phase": phase, "time": now,
                           "step_time": self.step_time}).encode()
        os.pwrite(self._fd, (text + b"\n%08x" % zlib.crc32(text)).ljust(SIZE), 0)


def parse(page: bytes) -> dict | None:
    """The beat on a page, or None when it is empty or torn (checksum does not match)."""
    text, _, crc = page.strip(b" \0").rpartition(b"\n")
    try:
        if text and len(crc) == 8 and int(crc, 16) == zlib.crc32(text):
            return json.loads(text)
    except (ValueError, UnicodeDecodeError):
        pass
    return None


def read(path: Path, tries: int = 50) -> dict | None:
    """One heartbeat file; None when absent, never written, or torn on every try (a writer
    preempted mid-copy on a busy host: the watchdog's next round reads it again)."""
    for i in range(tries):
        try:
            page = Path(path).read_bytes()
        except FileNotFoundError:
            return None
        if not page.strip(b" \0"):
            return None
        beat = parse(page)
        if beat is not None:
            return beat
        if i >= 5:
            time.sleep(0.001)  # let a preempted writer finish its copy
    return None


def read_all(run_dir: Path) -> list[dict]:
    beats = (read(p) for p in sorted((Path(run_dir) / rundir.HEARTBEAT).glob("rank-*.json")))
    return [b for b in beats if b is not None]
