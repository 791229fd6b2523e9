"""The hang watchdog: a thread in each torchrun agent that reads its workers' heartbeats.

When one of this agent's workers has made no progress for ``timeout_s`` seconds in the
training loop (its last heartbeat's phase is ``step`` or ``sync``; a rank saving or
evaluating is not judged, but the ranks waiting for it in the next step are)
(a SIGSTOPped process, a rank stuck in a collective, a dead-locked data loader), it

1. names the rank that stopped first: a process in state T (stopped) if there is one,
   else the rank whose last heartbeat is oldest (the others went on to wait for it in
   the next collective; their ``phase`` says which);
2. dumps every worker of this agent (hangdump.py): the last collectives of each process
   group from torch's flight recorder (asked through torch's worker server), and the
   native + Python stacks with ``py-spy dump --native`` (faulthandler on SIGUSR1 when py-spy
   is not installed or fails); the running ones are ended first, and only then is a stopped
   one continued to answer, so it cannot complete a step with peers that are gone;
3. writes ``run_dir/watchdog/hang-attempt<k>-node<i>.json`` (and ``fr-rank-<R>...json``,
   ``stacks-rank-<R>...txt``) and one line to stderr, with which rank waits in which
   collective that which rank never entered;
4. ends its workers with SIGKILL, so torchrun's agent restarts the group (``max_restarts``)
   and training resumes from the newest checkpoint.

It supervises nothing else: the restart, the rendezvous and the bookkeeping stay torch's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.launch import hangdump
from tandem.core.heartbeat import read_all, stack_file
from tandem.core import rundir


JUDGED = ("step", "sync")  # phases held to timeout_s; save, eval and done are not (they take their time)


def proc_state(pid: int) -> str | None:
    """Linux process state letter (R, S, D, T, Z...) or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text.rsplit(")", 1)[1].split()[0]


def _signal_main_thread(pid: int, sig: int) -> None:
    """tgkill(pid, pid, sig): the main thread handles it, so a stopped process dumps the stack
    where it stopped, before running on after SIGCONT (os.kill lets any thread take it)."""
    nr = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)
    if nr is not None:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).syscall(nr, pid, pid, sig) == 0:
            return
    os.kill(pid, sig)


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def first_stopped(beats: list[dict], host: str) -> tuple[dict, str]:
    """The rank that stopped first, and why we think so."""
    local = [b for b in beats if b.get("host") == host]
    stopped = [b for b in local if proc_state(b["pid"]) == "T"]
    if stopped:
        b = min(stopped, key=lambda b: (b["time"], b["rank"]))
        return b, "its process is stopped (state T, e.g. SIGSTOP)"
    b = min(beats, key=lambda b: (b["time"], b["step"], b["rank"]))
    return b, f"its last heartbeat is the oldest (step {b['step']}, phase {b['phase']})"


def _ends_a_line(f: Path) -> bool:
    with open(f, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


class Watchdog(threading.Thread):
    def __init__(self, run_dir: Path, timeout_s: float, node: int = 0, interval: float = 0.5) -> None:
        super().__init__(name="tandem-watchdog", daemon=True)
        self.run_dir, self.timeout_s, self.node, self.interval = Path(run_dir), float(timeout_s), node, interval
        self._stop_event = threading.Event()
        self.handled: set[int] = set()
        self.reports: list[Path] = []

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.check()
            except Exception as e:  # the watchdog must never take the agent down
                print(f"tandem watchdog: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def check(self, now: float | None = None) -> Path | None:
        now = now or time.time()
        beats = [b for b in read_all(self.run_dir) if alive(b["pid"])]
        mine = [b for b in beats if b.get("ppid") == os.getpid() and b["pid"] not in self.handled]
        stale = [b for b in mine if b["phase"] in JUDGED and now - b["time"] > self.timeout_s]
        if not stale:
            return None
        return self.fire(mine, [b for b in beats if b.get("attempt") == stale[0].get("attempt")], now)

    def fire(self, mine: list[dict], peers: list[dict], now: float) -> Path:
        host = socket.gethostname()
        first, why = first_stopped(peers, host)
        states = {b["rank"]: proc_state(b["pid"]) for b in mine}
        attempt = mine[0].get("attempt", 0)
        wd = self.run_dir / rundir.WATCHDOG
        wd.mkdir(parents=True, exist_ok=True)
        running = [b for b in mine if states[b["rank"]] != "T"]
        stopped = [b for b in mine if states[b["rank"]] == "T"]
        # 1. What needs no cooperation, before anything changes: the running ranks' flight
        #    recorders (torch's worker server answers from a C++ thread), then py-spy on every
        #    worker in parallel (a stopped one is read where it stopped, still stopped).
        asks = {b["rank"]: hangdump.Request(b["pid"], "fr_trace_json", timeout=10) for b in running}
        fr = {r: hangdump.flight_recorder(q) for r, q in asks.items()}
        spy = hangdump.pyspy_exe()
        stacks = {b["rank"]: {"tool": "faulthandler", "file": str(stack_file(self.run_dir, b["rank"], attempt)),
                              "why": "py-spy is not installed" if os.environ.get(hangdump.STACKS_ENV, "auto")
                              != "faulthandler" else f"{hangdump.STACKS_ENV}=faulthandler"} for b in mine}
        if spy:
            out = {b["rank"]: wd / f"stacks-rank-{b['rank']}.attempt{attempt}.pyspy.txt" for b in mine}
            with ThreadPoolExecutor(len(mine)) as ex:
                jobs = {b["rank"]: ex.submit(hangdump.pyspy_dump, spy, b["pid"], out[b["rank"]],
                                             states[b["rank"]] == "T") for b in mine}
            for r, job in jobs.items():
                tool, failed = job.result()
                stacks[r] = {"tool": tool, "file": str(out[r])} if failed is None else {**stacks[r], "why": failed}
        # 2. faulthandler where py-spy gave nothing, running ranks first; then end them. Only then
        #    is a stopped rank continued (to answer), so it cannot make progress with its peers.
        self._faulthandler([b for b in running if stacks[b["rank"]]["tool"] == "faulthandler"], stacks, False)
        self._kill(running)
        for b in stopped:
            ask = hangdump.Request(b["pid"], "fr_trace_json", timeout=3)  # queued while it is stopped
            try:  # pending until SIGCONT: its main thread holds still while the server answers (heartbeat.py)
                _signal_main_thread(b["pid"], signal.SIGUSR2)
            except ProcessLookupError:
                pass
            self._faulthandler([b] if stacks[b["rank"]]["tool"] == "faulthandler" else [], stacks, True)
            if stacks[b["rank"]]["tool"] != "faulthandler":
                self._cont(b)
            fr[b["rank"]] = hangdump.flight_recorder(ask)
        self._kill(stopped)
        collectives = {}
        for b in mine:
            f = fr.get(b["rank"], {"error": "not asked"})
            if "error" not in f:
                (wd / f"fr-rank-{b['rank']}.attempt{attempt}.json").write_text(json.dumps(f, indent=1))
            collectives[b["rank"]] = hangdump.summarize(f)
        waits = hangdump.waits({r: c for r, c in collectives.items() if "groups" in c})
        report = {
            "detected_at": now, "timeout_s": self.timeout_s, "node": self.node, "attempt": attempt, "host": host,
            "first_stopped_rank": first["rank"], "why": why,
            "stale_s": {b["rank"]: round(now - b["time"], 3) for b in peers},
            "ranks": {b["rank"]: {"step": b["step"], "phase": b["phase"], "pid": b["pid"],
                                  "state": states.get(b["rank"], proc_state(b["pid"])),
                                  "last_beat": b["time"]} for b in peers},
            "stacks": stacks,
            "stack_files": {r: s["file"] for r, s in stacks.items()},
            "collectives": collectives,
            "collective_waits": waits,
            "last_collective": {b["rank"]: ("gradient all-reduce of step %d" % (b["step"] + 1)
                                            if b["phase"] == "sync" else f"none pending ({b['phase']})")
                                for b in peers},  # the heartbeat's view, for ranks of other nodes too
        }
        out_file = wd / f"hang-attempt{attempt}-node{self.node}.json"
        out_file.write_text(json.dumps(report, indent=1))
        self.reports.append(out_file)
        ranks = sorted(b["rank"] for b in mine)
        tools = sorted({s["tool"] for s in stacks.values()})
        print(f"tandem watchdog (node {self.node}): no progress for {now - first['time']:.1f} s "
              f"(limit {self.timeout_s:g} s) on ranks {ranks}; rank {first['rank']} stopped first: {why}. "
              + (f"Flight recorder: {'; '.join(waits)}. " if waits else "")
              + f"Stacks ({', '.join(tools)}) and collectives: {out_file}; ending the group so that it restarts",
              file=sys.stderr, flush=True)
        self._kill(mine)
        return out_file

    def _faulthandler(self, group: list[dict], stacks: dict, cont: bool) -> None:
        """SIGUSR1 -> faulthandler in each worker (a stopped one also gets SIGCONT); wait for the files."""
        for b in group:
            try:
                _signal_main_thread(b["pid"], signal.SIGUSR1)
            except ProcessLookupError:
                pass
            if cont:
                self._cont(b)
        deadline = time.monotonic() + 3.0
        files = [Path(stacks[b["rank"]]["file"]) for b in group]
        # faulthandler writes a dump line by line and marks no end: a file is done when it is not
        # empty, ends a line, and has stopped growing (else the kill that follows cuts it short).
        seen: dict[Path, int] = {}
        while time.monotonic() < deadline:
            sizes = {f: f.stat().st_size if f.is_file() else 0 for f in files}
            if all(n and n == seen.get(f) and _ends_a_line(f) for f, n in sizes.items()):
                break
            seen = sizes
            time.sleep(0.05)  # waiting for the workers' own stack files, with a deadline

    @staticmethod
    def _cont(b: dict) -> None:
        try:
            os.kill(b["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _kill(self, group: list[dict]) -> None:
        for b in group:
            self.handled.add(b["pid"])
            try:
                os.kill(b["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            hangdump.forget(b["pid"])
