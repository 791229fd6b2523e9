"""One live `tandem train` per run dir: ``RUN_DIR/.lock`` holds its owner's pid, host and
process start time.

Two jobs in one run dir would interleave their metrics, overwrite each other's checkpoints
and resume from each other's half-written steps. ``acquire`` creates the lock atomically
(a link to a private file: exactly one of two racing starts wins); a lock whose owner is
gone (the same host, and no process with that pid and start time: a ``kill -9``, a crash)
is stale and taken over, with a line saying so. The owner's workers die with it (a
parent-death signal, see ``tandem/launch/orphans.py``), so a dead owner means a free run dir.
A lock from another host cannot be checked from here: it is refused, and the message says
how to clear it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from tandem.core import rundir
from tandem.core.errors import LaunchError


def process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if there is no such process.
    With the pid it names one process: a pid reused by a later process has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if pid == os.getpid():
            return "self"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "unknown"  # no /proc (not Linux): alive, start unknown
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie has finished: only its parent has not read its exit code yet
        return None
    return fields[19]


def alive(owner: dict) -> bool | None:
    """True/False for a lock of this host; None when it belongs to another host (unknowable)."""
    if owner.get("host") != socket.gethostname():
        return None
    start = process_start(int(owner.get("pid", -1)))
    return start is not None and (owner.get("start") in (None, start) or start == "unknown")


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / rundir.LOCK
        self.held = False

    def acquire(self, say=print) -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid()),
              "since": time.time()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{rundir.LOCK}.{os.getpid()}")
        tmp.write_text(json.dumps(me))
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)  # atomic: fails when a lock exists
                    self.held = True
                    return self
                except FileExistsError:
                    pass
                owner = self._owner()
                if owner is None:  # removed meanwhile, or unreadable (a kill while it was written)
                    self.path.unlink(missing_ok=True)
                    continue
                state = alive(owner)
                if state is False:
                    say(f"run dir lock {self.path}: its owner, pid {owner.get('pid')} on {owner.get('host')}, is "
                        "gone (killed or crashed); taking it over")
                    os.replace(tmp, self.path)
                    self.held = True
                    return self
                raise self._busy(owner, state)
            raise LaunchError("could not take the run dir's lock", field="launch.run_dir",
                              value=str(self.path.parent), fix=f"remove {self.path} if no job uses the run dir")
        finally:
            tmp.unlink(missing_ok=True)

    def _owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _busy(self, owner: dict, state: bool | None) -> LaunchError:
        since = time.strftime("%H:%M:%S", time.localtime(owner.get("since", 0)))
        who = f"pid {owner.get('pid')} on {owner.get('host')}, since {since}"
        if state is None:
            return LaunchError(f"the run dir is locked by a job on another host ({who})", field="launch.run_dir",
                               value=str(self.path.parent),
                               fix=f"give this run its own --launch.run_dir, or, if that job is gone, remove {self.path}")
        return LaunchError(f"the run dir is in use by a live `tandem train` ({who}); two jobs would overwrite "
                           "each other's metrics and checkpoints", field="launch.run_dir", value=str(self.path.parent),
                           fix=f"wait for it to finish or stop it (kill {owner.get('pid')}: it saves and exits), "
                               "or give this run its own --launch.run_dir")

    def release(self) -> None:
        if self.held:
            owner = self._owner()
            if owner and owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
