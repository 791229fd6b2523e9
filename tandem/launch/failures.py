"""Turn torchrun's ChildFailedError into a root-cause summary.

Each agent (one per node) writes the failures of its own workers to
``run_dir/failures/node-<k>.json``; the parent merges every node's file and
names the first failing rank. "First" is by the time the error file was written
(nanoseconds) or, for a worker killed by a signal, the time its agent saw it.
Failures that only report a lost peer (a gloo/NCCL connection closed because
another rank died) are consequences, not causes, so they rank after the rest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tandem.core import rundir

# Messages of ranks that failed because a peer went away, not on their own.
_PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"Socket Timeout|NCCL communicator was aborted|remote process exited|"
    r"Connection refused|Timed out waiting|recvBytes|Read error", re.I)


@dataclass
class Failure:
    rank: int
    local_rank: int
    node: int
    host: str
    exitcode: int
    pid: int
    time_ns: int
    message: str
    traceback: str
    error_file: str
    log_file: str

    @property
    def secondary(self) -> bool:
        return bool(_PEER_LOSS.search(self.message + self.traceback[-2000:]))

    @property
    def stopped(self) -> bool:
        """Ended by SIGTERM/SIGKILL with no record of its own: how torchrun stops the other workers once one
        has failed. Its time is torch's whole-second timestamp of when the agent noticed, which can sort it
        ahead of the rank that really failed first (an EADDRINUSE seen in the README doc test)."""
        return self.exitcode in (-signal.SIGTERM, -signal.SIGKILL) and not os.path.isfile(self.error_file)


def from_child_failed(err, node: int, run_dir: Path, stderr_of: dict[int, str] | None = None) -> list[Failure]:
    """Failures of one agent's workers, from torch's ChildFailedError; ``stderr_of``: each rank's
    stderr file in the failed attempt (RankLogsSpecs), else the first attempt's name."""
    out = []
    for rank, pf in err.failures.items():
        data = pf.error_file_data or {}
        msg = data.get("message", pf.message)
        tb = ""
        if isinstance(msg, dict):
            tb = msg.get("extraInfo", {}).get("py_callstack", "")
            msg = msg.get("message", "")
        t_ns = pf.timestamp * 1_000_000_000
        if pf.error_file and os.path.isfile(pf.error_file):
            t_ns = os.stat(pf.error_file).st_mtime_ns
        log = Path((stderr_of or {}).get(int(rank)) or run_dir / rundir.LOGS / f"rank-{rank}.err.log")
        if not tb and log.is_file():  # no @record (a signal, a fatal error): what stderr says
            fatal, tb = _from_stderr(log.read_text(errors="replace"))
            if fatal and (not msg or msg == "<NONE>"):
                msg = fatal
        out.append(Failure(rank=int(rank), local_rank=pf.local_rank, node=node, host=socket.gethostname(),
                           exitcode=pf.exitcode, pid=pf.pid, time_ns=t_ns, message=str(msg or pf.message),
                           traceback=tb, error_file=str(pf.error_file), log_file=str(log)))
    return out


def _from_stderr(text: str) -> tuple[str, str]:
    """(the fatal error line, the stacks) of a rank that died without an error file.

    A crash in native code (SIGSEGV, SIGBUS, abort) is reported by faulthandler, which torch's
    ``@record`` enables: "Fatal Python error: ...", every thread's stack, then one line listing
    every extension module loaded (kilobytes, and no help). Keep the first two; otherwise the
    tail of stderr is the best there is."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")), None)
    if start is None:
        return "", "".join(lines[-25:])
    block = []
    for line in lines[start:]:
        if line.startswith("Extension modules:"):
            break
        block.append(line)
    return lines[start].strip(), "".join(block[:60])


def _signal(exitcode: int) -> str:
    """torchrun reports a worker killed by signal N as exit code -N: its name, or N."""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return str(-exitcode)


def signal_name(exitcode: int) -> str:
    return f"signal {-exitcode} ({_signal(exitcode)})"


def write_node_failures(run_dir: Path, node: int, failures: list[Failure]) -> Path:
    d = run_dir / rundir.FAILURES
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"node-{node}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(f) for f in failures], indent=2))
    os.replace(tmp, path)
    return path


def read_failures(run_dir: Path) -> list[Failure]:
    out = []
    for p in sorted((run_dir / rundir.FAILURES).glob("node-*.json")):
        out += [Failure(**d) for d in json.loads(p.read_text())]
    return out


def root_cause(failures: list[Failure]) -> Failure | None:
    if not failures:
        return None
    return min(failures, key=lambda f: (f.secondary, f.stopped, f.time_ns, f.rank))


def summarize(failures: list[Failure]) -> str:
    """One paragraph for the error line: who failed first and how."""
    first = root_cause(failures)
    if first is None:
        return "workers failed (no failure record found)"
    how = f"exit code {first.exitcode}" if first.exitcode >= 0 else signal_name(first.exitcode)
    what = first.message.strip().splitlines()[-1] if first.message.strip() else ""
    return (f"rank {first.rank} (node {first.node}, local rank {first.local_rank}, host {first.host}) failed "
            f"first with {how}{': ' + what if what and what != '<NONE>' else ''}; "
            f"{len(failures)} rank(s) failed in all; log: {first.log_file}")


def render(failures: list[Failure], console: Console) -> None:
    first = root_cause(failures)
    if first is None:
        return
    table = Table(title="Worker failures (root cause first)", show_lines=False)
    for col in ("rank", "node", "local", "exit", "message"):
        table.add_column(col)
    ordered = sorted(failures, key=lambda f: (f is not first, f.secondary, f.stopped, f.time_ns))
    for f in ordered:
        mark = "[bold red]root cause[/] " if f is first else ""
        table.add_row(str(f.rank), str(f.node), str(f.local_rank),
                      str(f.exitcode) if f.exitcode >= 0 else _signal(f.exitcode),
                      mark + escape((f.message.strip().splitlines() or [""])[-1][:160]))
    console.print(table)
    if first.traceback:
        where = first.error_file if os.path.isfile(first.error_file) else first.log_file
        console.print(f"[bold]Traceback of rank {first.rank}[/] ({escape(where)}):", highlight=False)
        console.print(first.traceback.rstrip(), highlight=False, markup=False)
