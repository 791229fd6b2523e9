"""What the hang watchdog collects from each worker: stacks and the last collectives.

Both come from tools torch and Python already have:

* **Collectives: torch's flight recorder.** torch 2.13 records every collective of every
  process group, gloo included (on by default; ``TORCH_FR_BUFFER_SIZE`` entries, 0 turns it
  off): op, sizes, sequence number, and per group the last enqueued and last completed
  sequence number. A hung rank cannot run Python, so each worker starts torch's own worker
  server (``torch._C._distributed_c10d._WorkerServer``, what ``torch.distributed.elastic.
  control_plane.worker_main`` starts): a C++ thread on a unix socket that answers
  ``fr_trace_json`` while the main thread waits inside a collective. A SIGSTOPped process
  answers once continued.
* **Stacks: py-spy when installed** (``pip install tandem[debug]``): ``py-spy dump --native``
  from the agent reads the worker's Python and C++ frames with ptrace, without the worker's
  help (a stopped process is read as it is, Python frames only: see ``pyspy_dump``). Otherwise, or when py-spy fails (no ptrace
  permission), faulthandler in the worker writes its Python stacks on SIGUSR1 (heartbeat.py).
  ``TANDEM_HANG_STACKS=faulthandler`` forces the fallback.

The worker serves it on ``contract.socket_path(pid)`` (``contract.serve``, the worker's side of
the request); this module is the agent's side.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tandem.core.contract import serve, socket_path  # noqa: F401 (serve: the worker side, for callers of old)

STACKS_ENV = "TANDEM_HANG_STACKS"  # auto (default), py-spy, faulthandler


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.path))


class Request:
    """A handler call of a worker's server. Sent at once (a stopped worker's kernel queues it),
    answered when ``result`` reads the reply."""

    def __init__(self, pid: int, handler: str, timeout: float = 5.0) -> None:
        self.conn = _UnixHTTP(socket_path(pid), timeout)
        self.error: str | None = None
        try:
            self.conn.request("POST", f"/handler/{handler}")
        except OSError as e:
            self.error = f"no worker server at {socket_path(pid)} ({type(e).__name__}: {e})"

    def result(self) -> bytes:
        if self.error:
            raise OSError(self.error)
        try:
            r = self.conn.getresponse()
            body = r.read()
        except (OSError, http.client.HTTPException) as e:
            raise OSError(f"worker server did not answer ({type(e).__name__}: {e})") from e
        finally:
            self.conn.close()
        if r.status != 200:
            raise OSError(f"worker server answered {r.status}: {body[:200]!r}")
        return body


def flight_recorder(req: Request) -> dict:
    """The worker's flight recorder dump, or ``{"error": why}``."""
    try:
        return json.loads(req.result())
    except (OSError, ValueError) as e:
        return {"error": str(e)}


def summarize(fr: dict, last: int = 4) -> dict:
    """Per process group: the last entered (enqueued) and completed sequence numbers, the
    collectives not marked completed, and the last few. gloo entries stay 'scheduled' (no start
    or end per entry), and a group's completed number is updated by gloo's worker thread a
    moment after the waiting rank has moved on: read ``completed`` as a lower bound."""
    if "error" in fr:
        return {"source": "flight recorder", "error": fr["error"]}
    groups = {}
    for pg, st in (fr.get("pg_status") or {}).items():
        done, entered = int(st["last_completed_collective"]), int(st["last_enqueued_collective"])
        ents = [e for e in fr.get("entries", []) if str(e["pg_id"]) == pg and not e.get("is_p2p")]
        if not ents:
            continue

        def show(e):
            return f"#{e['collective_seq_id']} {e['profiling_name']} {e['input_sizes']}"
        groups[ents[-1]["process_group"][1]] = {
            "pg_id": pg, "entered": entered, "completed": done, "newest": show(ents[-1]),
            "pending": [show(e) for e in ents if e["collective_seq_id"] > done],
            "last": [show(e) for e in ents[-last:]]}
    if not groups:
        return {"source": "flight recorder", "error": "no collectives recorded (TORCH_FR_BUFFER_SIZE=0?)"}
    return {"source": "flight recorder", "groups": groups}


def waits(per_rank: dict[int, dict]) -> list[str]:
    """Per process group: which ranks wait in a collective that which ranks never entered.
    Judged on the entered numbers (exact), not on completion (late by a moment, see summarize)."""
    lines = []
    by_group: dict[str, dict[int, dict]] = {}
    for rank, s in per_rank.items():
        for name, g in (s.get("groups") or {}).items():
            by_group.setdefault(name, {})[rank] = g
    for name, ranks in sorted(by_group.items()):
        top = max(g["entered"] for g in ranks.values())
        ahead = sorted(r for r, g in ranks.items() if g["entered"] == top and g["completed"] < top)
        if not ahead:
            continue
        behind = sorted(r for r, g in ranks.items() if g["entered"] < top)
        newest = ranks[ahead[0]]["newest"]
        if behind:  # the first collective a rank behind never entered (gloo enqueues a few at once)
            missing = f"#{min(ranks[r]['entered'] for r in behind) + 1} "
            first = next((p for p in ranks[ahead[0]]["pending"] if p.startswith(missing)), newest)
            more = f" (and {top - int(first.split()[0][1:])} more after it)" if first != newest else ""
            lines.append(f"{name}: rank(s) {ahead} wait in {first}{more}, which rank(s) {behind} never entered "
                         f"(last entered: {', '.join('#%d' % ranks[r]['entered'] for r in behind)})")
        else:
            lines.append(f"{name}: rank(s) {ahead} all entered {newest} and wait in it")
    return sorted(lines, key=lambda line: "never entered" not in line)  # a rank left behind first


def pyspy_exe() -> str | None:
    """py-spy next to this Python (a venv's bin) or on PATH; None when absent or switched off."""
    if os.environ.get(STACKS_ENV, "auto") == "faulthandler":
        return None
    near = Path(sys.executable).parent / "py-spy"
    return str(near) if near.is_file() else shutil.which("py-spy")


def pyspy_dump(exe: str, pid: int, out: Path, stopped: bool, timeout: float = 20.0) -> tuple[str, str | None]:
    """Write a py-spy dump of ``pid`` to ``out``: (the command used, None or why it failed).

    ``--native`` (C++ frames too) suspends the process with ptrace, which py-spy 0.4 cannot do
    to a process already stopped ("unexpected waitpid result"); such a process cannot move, so
    ``--nonblocking`` reads a consistent Python stack, without native frames."""
    err = None
    for flag in (["--nonblocking"] if stopped else ["--native", ""]):
        cmd = [exe, "dump", *([flag] if flag else []), "--pid", str(pid)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            err = f"py-spy dump took over {timeout:g} s"
            continue
        if r.returncode == 0 and r.stdout.strip():
            out.write_text(r.stdout)
            return " ".join(["py-spy dump", *([flag] if flag else [])]), None
        err = f"py-spy dump exited {r.returncode}: {' '.join(r.stderr.split())[:300]}"
    return "py-spy dump", err


def forget(pid: int) -> None:
    """The worker is gone (SIGKILL skips its atexit): remove its socket."""
    socket_path(pid).unlink(missing_ok=True)
