"""The worker/agent contract: what a worker and the agent that runs it agree on.

Both sides import this module (``tandem.launch`` on the agent side, ``tandem.train`` on the
worker side), so neither needs the other:

* environment variables the agent sets for its workers (device, backend, run dir, the
  agent's own pid and the attempt counters);
* the group's attempt number (``attempt``) and torchrun's run id;
* the hang-dump request: each worker serves torch's worker server on a unix socket named by
  its pid (``socket_path``, ``serve``), which the agent's watchdog asks for the flight recorder;
* the heartbeat page (``tandem.core.heartbeat``) and the run dir's names (``tandem.core.rundir``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tandem.core.environment import ENV_BACKEND, ENV_DEVICE  # noqa: F401 (the launcher's choice, for workers)

ENV_RUN_DIR = "TANDEM_RUN_DIR"
ATTEMPT_ENV = "TANDEM_ATTEMPT"  # the group's attempt, agreed by the workers (resume.agree_attempt)
AGENT_STARTS_ENV = "TANDEM_AGENT_STARTS"  # this agent's worker starts so far (launch/logs.py)
JOINING_ENV = "TANDEM_JOINING"  # an agent joining a running job: log names of its own


def run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def attempt() -> int:
    """This worker group's attempt: torchrun's restart count, or the run-wide attempt the
    ranks agreed on (``resume.agree_attempt``), which also counts restarts for a joining node."""
    return int(os.environ.get(ATTEMPT_ENV, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


# -- the hang-dump request: the worker's side ------------------------------------------------------

def socket_path(pid: int) -> Path:
    """``$TMPDIR/tandem-ws-<uid>/<pid>.sock``: the agent knows its workers' pids from their
    heartbeats, and the path stays under the 107-byte limit of a unix socket name. One folder
    per user, private: another user's workers neither block nor reach ours."""
    return Path(tempfile.gettempdir()) / f"tandem-ws-{os.getuid()}" / f"{pid}.sock"


_SERVER = None


def serve() -> str | None:
    """In a worker: start torch's worker server for this process. None, or why it is not there."""
    global _SERVER
    if _SERVER is not None:
        return None
    try:
        from torch._C._distributed_c10d import _WorkerServer
    except ImportError as e:
        return f"this torch has no worker server ({e})"
    path = socket_path(os.getpid())
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _sweep(path.parent)  # sockets of killed workers (SIGKILL runs no atexit), this pid's old one included
    try:
        _SERVER = _WorkerServer(str(path))
    except Exception as e:  # the dump falls back to heartbeats; training must not fail for it
        return f"worker server did not start: {type(e).__name__}: {e}"
    import atexit

    # Not _SERVER.shutdown(): in torch 2.13 it hangs when the server never had a request.
    # The server's thread ends with the process; its socket file would stay.
    atexit.register(path.unlink, missing_ok=True)
    return None


def _sweep(folder: Path) -> None:
    for p in folder.glob("*.sock"):
        try:
            pid = int(p.stem)
            if pid != os.getpid():
                os.kill(pid, 0)
                continue
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        p.unlink(missing_ok=True)
