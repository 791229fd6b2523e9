"""A job's rank logs read back as one stream, and whether the job has ended: what `tandem logs RUN_DIR
[--follow] [--rank R] [--attempt N]` prints (cli/logs.py). launch/logs.py names the files as they are
written (and imports torch); this side only reads, and needs no torch.

Reads only the run dir (the names are in tandem/core/rundir.py and launch/logs.py):

    logs/rank-R[.join-H-P][.attemptN][.restartK][.err].log

Every line is printed with its rank, ``[rank R]`` (``[rank R restart K]`` for a later start of
the workers within the attempt, ``stderr`` for the error stream). By default the current
attempt: the newest start of the run dir (attempts.jsonl, or the newest attempt in the file
names). ``--follow`` keeps reading while the job lives and stops when it has ended, known from
the run dir and, for a `tandem submit --on slurm` job, from the controller:

    1. Slurm (submit/job.json): the job's state in `scontrol show job` (ended: a final state,
       or forgotten by the controller);
    2. RUN_DIR/.lock: a live `tandem train` holds it;
    3. attempts.jsonl: the newest start's process (pid and host) still runs;
    4. result.json: the run finished (the only sign left when the job ran on another host).
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from tandem.core import rundir
from tandem.core.runlock import alive, process_start

NAME = re.compile(r"^rank-(?P<rank>\d+)(?P<join>\.join-.+?-\d+)?(?:\.attempt(?P<attempt>\d+))?"
                  r"(?:\.restart(?P<restart>\d+))?(?P<err>\.err)?\.log$")


@dataclass(frozen=True)
class RankLog:
    path: Path
    rank: int
    attempt: int
    restart: int
    err: bool
    join: str

    @property
    def order(self) -> tuple:
        return (self.attempt, self.restart, self.rank, self.join, self.err)

    def prefix(self, first_attempt: int) -> str:
        parts = [f"rank {self.rank}"]
        if self.attempt != first_attempt:  # --follow went on into a requeued start
            parts.append(f"attempt {self.attempt}")
        if self.restart:
            parts.append(f"restart {self.restart}")
        if self.err:
            parts.append("stderr")
        return "[" + " ".join(parts) + "]"


def scan(run_dir: Path) -> list[RankLog]:
    """Every rank log in the run dir, oldest start first."""
    out = []
    for p in (Path(run_dir) / rundir.LOGS).glob("rank-*.log"):
        m = NAME.match(p.name)
        if m:
            out.append(RankLog(p, int(m["rank"]), int(m["attempt"] or 1), int(m["restart"] or 0), bool(m["err"]),
                               m["join"] or ""))
    return sorted(out, key=lambda f: f.order)


def current_attempt(run_dir: Path, files: list[RankLog]) -> int:
    starts = rundir.attempts(run_dir)
    return max([1, *(f.attempt for f in files), *([starts[-1]["attempt"]] if starts else [])])


def job_end(run_dir: Path) -> str | None:
    """Why the job is over, or None while it may still write logs (a Slurm job asks its controller first:
    tandem.submit.slurm.slurm_job_end, chosen by the verb)."""
    sub = _read_json(Path(run_dir) / "submit" / "job.json") or {}
    if sub.get("engine") in ("ssh", "ray") and sub.get("state") in ("DONE", "COMPLETED", "FAILED", "CANCELLED", "LOST"):
        return f"{sub['engine']} job {sub['state']}"   # tandem submit recorded the end (the first host may be remote)
    lock = _read_json(Path(run_dir) / rundir.LOCK)
    if lock is not None and alive(lock) is not False:
        return None
    starts = rundir.attempts(run_dir)
    if starts and starts[-1].get("host") == socket.gethostname() and _runs(starts[-1]):
        return None
    if starts and starts[-1].get("host") != socket.gethostname() and not (Path(run_dir) / rundir.RESULT).is_file():
        return None  # started on another host and not finished: only result.json would tell
    return "finished" if (Path(run_dir) / rundir.RESULT).is_file() else "its process has exited"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _runs(start: dict) -> bool:
    """Whether the process that recorded ``start`` (attempts.jsonl) still runs: its pid, started no later than
    the record (a pid reused by a later process started after it)."""
    ticks = process_start(int(start.get("pid", -1)))
    if ticks is None:
        return False
    if not ticks.isdigit():  # "self" / "unknown": no /proc to tell its age
        return True
    try:
        btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                     if ln.startswith("btime "))
        began = btime + int(ticks) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError):
        return True
    return began <= float(start.get("time", 0)) + 2  # btime has 1 s resolution


class Tail:
    """Complete lines appended to a set of files since the last read, each with its prefix."""

    def __init__(self, first_attempt: int) -> None:
        self.first = first_attempt
        self.pos: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}

    def read(self, files: list[RankLog], final: bool = False) -> list[str]:
        out = []
        for f in files:
            try:
                with open(f.path, "rb") as fh:
                    fh.seek(self.pos.get(f.path, 0))
                    data = fh.read()
            except OSError:
                continue
            self.pos[f.path] = self.pos.get(f.path, 0) + len(data)
            buf = self.partial.pop(f.path, b"") + data
            *lines, rest = buf.split(b"\n")
            if rest and final:  # the job is over: its last line will not be completed
                lines.append(rest)
            elif rest:
                self.partial[f.path] = rest
            pre = f.prefix(self.first)
            out += [f"{pre} {ln.decode(errors='replace').rstrip(chr(13))}" for ln in lines]
        return out
