"""Run an ssh job (ssh_plan.py's Plan), and `tandem status` / `tandem cancel` of one, from RUN_DIR/submit/job.json.

    code = run_job(plan)        # one ssh client per host; their lines printed as `[host] ...`; blocks
    state, line = ssh_status(run_dir)
    ssh_cancel(run_dir)         # `ssh HOST kill -TERM AGENT_PID` on every host still running

The record (submit/job.json, record.py, rewritten whole at each change) holds the hosts in node order,
each with its agent's pid (the remote shell's first line) and its exit code once ssh returns,
and the submitting process's host and pid. When one host fails, the others' agents get
SIGTERM at once (what `srun --kill-on-bad-exit` does): nobody waits on a collective whose peer
is gone. The ssh clients run in a process group of their own, so a Ctrl-C reaches this process
only, which passes it on as that same SIGTERM through ssh; they also die with this process
(parent-death signal), and the remote agents die with their ssh sessions (ssh_remote.py).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.launch.orphans import die_with_parent
from tandem.submit.record import read_record, submit_dir, write_record
from tandem.submit.ssh_plan import PID_TAG, Plan, SshJob, ssh_base

CANCELLED = "cancelled"  # RUN_DIR/submit/cancelled: `tandem cancel` asked, so the end is CANCELLED, not FAILED
DONE_STATES = ("DONE", "FAILED", "CANCELLED")


def _ssh_job(rec: dict) -> SshJob:
    return SshJob(run_dir=Path("."), command=[], hosts=[], ssh_config=rec.get("ssh_config", ""))


def kill_agents(job: SshJob, nodes: list[dict], sig: str = "TERM", timeout: float = 30) -> list[str]:
    """`ssh HOST kill -SIG PID` for every node whose agent runs; the hosts that were told. Only a process
    that is still our agent is signalled (pids are reused once it has ended)."""
    live = [n for n in nodes if n.get("pid") and n.get("rc") is None]

    def one(n: dict) -> str | None:
        try:
            pid = int(n["pid"])
            cmd = f"grep -qE 'tandem[.](cli|launch)[.]ssh_remote' /proc/{pid}/cmdline && kill -{sig} {pid}"
            r = subprocess.run([*ssh_base(job), n["host"], cmd], capture_output=True,
                               stdin=subprocess.DEVNULL, timeout=timeout)
            return n["host"] if r.returncode == 0 else None
        except subprocess.TimeoutExpired:
            return None
    if not live:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(live))) as pool:
        return [h for h in pool.map(one, live) if h]


def _die_with_us() -> None:  # in the forked child, before exec: its parent is this process
    die_with_parent(os.getppid(), signal.SIGTERM)


class _Node:
    """One host's ssh client: reads its stdout and stderr, prints each line with the host's prefix."""

    def __init__(self, plan: Plan, index: int, lock: threading.Lock, on_pid, exits: queue.Queue) -> None:
        self.host = plan.nodes[index][0].name
        self.index, self.lock, self.on_pid = index, lock, on_pid
        self.last_err = ""
        self.proc = subprocess.Popen(plan.argv[index], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1,
                                     process_group=0, preexec_fn=_die_with_us)
        self.readers = [threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout, True), daemon=True),
                        threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr, False), daemon=True)]
        for t in self.readers:
            t.start()
        threading.Thread(target=self._wait, args=(exits,), daemon=True).start()

    def _wait(self, exits: queue.Queue) -> None:
        """Its exit, once its last lines (the error) are printed: output ends when the session does."""
        for t in self.readers:
            t.join()
        self.proc.wait()
        exits.put(self.index)

    def _pump(self, src, dst, is_out: bool) -> None:
        first = is_out
        for line in src:
            if first and line.startswith(PID_TAG + " "):
                first = False
                self.on_pid(self.index, int(line.split()[1]))
                continue
            if line.strip() and not is_out and not line.startswith("[rank"):  # the agent's own, not a worker's
                self.last_err = line.strip()
            with self.lock:
                dst.write(f"[{self.host}] {line}" if line.endswith("\n") else f"[{self.host}] {line}\n")
                dst.flush()


def run_job(plan: Plan) -> int:
    """Start every host's agent, stream their output, record them; 0 when every host exits 0."""
    job = plan.job
    run_dir = job.run_dir if job.run_dir.is_absolute() else job.workdir / job.run_dir
    (submit_dir(run_dir) / CANCELLED).unlink(missing_ok=True)
    rec = {"engine": "ssh", "state": "RUNNING", "reason": "", "submit_host": socket.gethostname(),
           "submit_pid": os.getpid(), "submit_started": _started(os.getpid()), "started": time.time(),
           "ended": None, "world": plan.world,
           "master": f"{plan.master_addr}:{job.master_port}", "command": job.command, "ssh_config": job.ssh_config,
           "env_keys": list(plan.env),
           "nodes": [{"host": h.name, "node_rank": i, "nproc": k, "pid": None, "rc": None}
                     for i, (h, k) in enumerate(plan.nodes)]}
    lock = threading.Lock()
    write_record(run_dir, rec)

    def on_pid(i: int, pid: int) -> None:
        with lock:
            rec["nodes"][i]["pid"] = pid
            write_record(run_dir, rec)

    told: list[int] = []
    clients: list[_Node] = []

    def stop_all(signum, frame) -> None:  # Ctrl-C / SIGTERM: every agent stops (and saves) like one would
        told.append(signum)
        for n in clients:   # no agent pid yet: closing its ssh session stops it (ssh_remote.py)
            if rec["nodes"][n.index].get("pid") is None and n.proc.poll() is None:
                n.proc.terminate()
        threading.Thread(target=kill_agents, args=(job, rec["nodes"], "TERM" if len(told) == 1 else "KILL"),
                         daemon=True).start()

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, stop_all) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    exits: queue.Queue[int] = queue.Queue()  # node indices in the order their ssh sessions ended
    nodes = [_Node(plan, i, lock, on_pid, exits) for i in range(len(plan.nodes))]
    clients.extend(nodes)
    first_bad: _Node | None = None
    try:
        while any(r["rc"] is None for r in rec["nodes"]):
            try:
                n = nodes[exits.get(timeout=0.5)]  # a timeout: signal handlers run in this thread meanwhile
            except queue.Empty:
                continue
            with lock:
                rec["nodes"][n.index]["rc"] = n.proc.returncode
                write_record(run_dir, rec)
            if n.proc.returncode != 0 and first_bad is None:
                first_bad = n
                if any(r["rc"] is None for r in rec["nodes"]):
                    threading.Thread(target=kill_agents, args=(job, rec["nodes"]), daemon=True).start()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    cancelled = (submit_dir(run_dir) / CANCELLED).exists() or bool(told)
    codes = [r["rc"] for r in rec["nodes"]]
    if not any(codes):
        state, reason, code = "DONE", f"every host exited 0 (world {plan.world})", 0
    elif cancelled:
        state, code = "CANCELLED", 128 + (told[0] if told else 15)
        reason = "the agents were sent SIGTERM (tandem cancel, or a signal to tandem submit)"
    else:
        state, code = "FAILED", 1
        reason = (f"host {first_bad.host} (node {first_bad.index}) exited with {codes[first_bad.index]} first"
                  f"{'' if codes[first_bad.index] != 255 else ' (its agent was killed, or ssh lost the connection)'}"
                  f"{': ' + first_bad.last_err if first_bad.last_err else ''}; the other hosts were stopped")
    rec.update(state=state, reason=reason, ended=time.time())
    write_record(run_dir, rec)
    print(f"tandem submit: {state.lower()}: {reason}", file=sys.stderr if code else sys.stdout, flush=True)
    return code


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None when it is gone
    or a zombie: with the pid, it names one process (pids are reused)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _alive(rec: dict) -> bool:
    if not Path("/proc/self/stat").exists():  # no procfs: ask the kernel, and trust the pid
        try:
            os.kill(rec["submit_pid"], 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return _started(rec["submit_pid"]) == rec.get("submit_started")


def ssh_status(run_dir: Path) -> tuple[str, str]:
    """(state, one line): RUNNING, DONE, FAILED, CANCELLED, or LOST (the submitting process is gone)."""
    rec = read_record(run_dir)
    hosts = ", ".join(f"{n['host']} (node {n['node_rank']}, {n['nproc']} worker(s), agent pid {n['pid'] or '?'}"
                      + ("" if n["rc"] is None else f", exit {n['rc']}") + ")" for n in rec["nodes"])
    head = f"ssh job, world {rec['world']} on {len(rec['nodes'])} host(s)"
    if rec["state"] in DONE_STATES:
        return rec["state"], f"{rec['state']}: {head}: {rec['reason']}"
    here = rec["submit_host"] == socket.gethostname()
    if here and not _alive(rec):
        return "LOST", (f"LOST: {head}: tandem submit (pid {rec['submit_pid']}) ended before the job did; "
                        f"agents may still run on: {hosts}. Fix: tandem cancel {run_dir}")
    since = time.time() - rec["started"]
    where = "" if here else f" (submitted from {rec['submit_host']}, pid {rec['submit_pid']})"
    return "RUNNING", f"RUNNING: {head} for {since:.0f} s{where}: {hosts}"


def ssh_cancel(run_dir: Path) -> list[str]:
    """SIGTERM to every host's agent still running (they stop their workers, a train job saves); the hosts."""
    rec = read_record(run_dir)
    if rec["state"] in DONE_STATES:
        return []
    (submit_dir(run_dir) / CANCELLED).touch()
    told = kill_agents(_ssh_job(rec), rec["nodes"])
    if rec["submit_host"] == socket.gethostname() and not _alive(rec):
        rec.update(state="CANCELLED", reason="cancelled after tandem submit had ended", ended=time.time())
        write_record(run_dir, rec)
    return told
