"""A graceful stop: on SIGTERM (or Ctrl-C's SIGINT), checkpoint at a step every rank agrees on, then exit.

torchrun's agent stops its workers with SIGTERM and kills them 30 s later: when a node joins
(the group restarts at the larger world), when the agent itself gets SIGTERM (a scheduler
preempting the job, Kubernetes evicting a pod, ``kill`` on ``tandem train``) and when a
worker failed. Without a handler the worker dies at once and the restart redoes every step
since the last periodic checkpoint.

With ``elastic.save_on_term`` (on by default) the signal only raises a flag. The flag rides
on the step's loss all-reduce (``runtime.PendingSum``, already paid for), so one step later
every rank reads the same sum at the same step, saves the same checkpoint there and exits
(the ``Stopped`` exception: exit code 1, its message in the rank's error file), and the
restart redoes no step. A SIGTERM that reaches one node only (one pod drained) stops the
whole group at one step just the same. Ctrl-C in a terminal sends SIGINT to every process of the
job, and torchrun's agent passes its own SIGINT on to the workers: it is handled the same way,
so Ctrl-C keeps the work done, as a preemption does.

A rank that cannot reach that step (a peer died or hangs, so a collective never returns)
must not hold the restart back for torchrun's 30 s. Python runs a signal handler only when
the main thread is back in the interpreter, which a rank blocked in a collective never is;
so the signal is also caught by a thread of ours through ``signal.set_wakeup_fd`` (written
by the C-level handler at once, whatever the main thread does). That thread raises the flag
and, when no step finishes for ``grace_s`` seconds (not counting time in a save or an
evaluation), ends the process with exit code 143.

Two cases do not wait for an agreed step:

* A second Ctrl-C (SIGINT after a first stop signal): the user wants out now. The rank exits at
  once, without a checkpoint (exit code 130). The parent's second Ctrl-C ends the agents, and
  their workers die with them (``tandem/launch/orphans.py``).
* A peer's death. torchrun's agent stops the survivors of a failed worker with the same
  SIGTERM as a user's stop; waiting ``grace_s`` for a step a dead rank can never join only
  delays the restart. While it waits for the agreed step, the rank checks its peers
  (``peer_gone``: the heartbeat pages of this attempt name each rank's pid and host; a rank
  of this host whose process is gone is dead) and, when one is, exits at once without a
  checkpoint. Peers on other hosts are not checked: their death breaks the next collective,
  which fails fast (gloo: connection reset), or the grace period ends the wait.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
SIGNALS = (signal.SIGTERM, signal.SIGINT)
PEER_POLL_S = 0.1  # how often a rank waiting for an agreed step looks for a dead peer


class Stopped(Exception):
    """The group stopped on SIGTERM after saving a checkpoint (``@record`` writes this to the
    rank's error file, so the failure summary says why the rank ended)."""


class StopRequest:
    def __init__(self, enabled: bool, grace_s: float = 10.0,
                 peer_gone: Callable[[], str | None] | None = None) -> None:
        self.peer_gone = peer_gone  # None, or a line naming a dead peer (then no step can be agreed)
        self.flag = 0.0  # summed over ranks with the step's loss: > 0 means some rank was told to stop
        self.signal_time: float | None = None
        self.signum = signal.SIGTERM  # the first stop signal received
        self.grace_s = grace_s
        self.pid = os.getpid()
        self._last_progress = time.monotonic()
        self._done = threading.Event()  # the stop was agreed, or the run is over: no deadline
        self._lock = threading.Lock()
        self._installed = enabled and threading.current_thread() is threading.main_thread()
        if not self._installed:
            return
        self._previous = {s: signal.signal(s, self._on_term) for s in SIGNALS}
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._wakeup = (r, w)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="tandem-stop-watch", daemon=True).start()
        os.register_at_fork(after_in_child=self._in_child)

    def _in_child(self) -> None:
        # A forked DataLoader worker: not a rank. Default SIGTERM, and no writes into our pipe.
        if self._installed:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
            except ValueError:  # forked from another thread: _on_term checks the pid instead
                pass

    def _on_term(self, signum, frame) -> None:
        if os.getpid() == self.pid:
            return  # the watcher thread reads every delivery from the wakeup fd: counted once, there
        else:  # caught in a forked child before _in_child ran: end it as the signal would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                data = b""
            if not data:  # closed by close()
                os.close(r)
                return
            for b in data:  # one byte per delivery: a second Ctrl-C is a second byte
                if b in SIGNALS:
                    self._raise(b)
            if self._old_wakeup != -1:  # someone else's wakeup fd, set before ours: pass the bytes on
                try:
                    os.write(self._old_wakeup, data)
                except OSError:
                    pass

    def _raise(self, signum: int) -> None:
        with self._lock:
            if self.signal_time is not None:
                if signum == signal.SIGINT and self.signum == signal.SIGINT:
                    # a second Ctrl-C: out now, no checkpoint (a save under way is left as .tmp-step-N)
                    print("SIGINT again: stopping at once, without a checkpoint", file=sys.stderr, flush=True)
                    os._exit(128 + signal.SIGINT)
                return  # a repeated SIGTERM changes nothing: the save is coming or the deadline ends us
            self.flag, self.signal_time, self.signum = 1.0, time.time(), signum
        print(f"{signal.Signals(signum).name} received: the group saves a checkpoint at the next step all ranks "
              f"agree on, then exits{'; Ctrl-C again stops at once, without one' if signum == signal.SIGINT else ''}",
              file=sys.stderr, flush=True)
        threading.Thread(target=self._deadline, name="tandem-stop-deadline", daemon=True).start()

    def progress(self, busy: bool = False) -> None:
        """A step finished (the deadline counts from here), or a save or an evaluation starts
        (``busy``: no deadline until the next step; a save stuck on a dead peer is left to
        torchrun's SIGKILL)."""
        self._busy = busy
        self._last_progress = time.monotonic()

    _busy = False

    def _deadline(self) -> None:
        while not self._done.is_set():
            gone = self.peer_gone() if self.peer_gone else None
            if gone and not self._done.is_set():
                # Checked while a save runs too: a save with a dead peer cannot complete either.
                print(f"{signal.Signals(self.signum).name}: {gone}; no step can be agreed, exiting at once "
                      "without a checkpoint", file=sys.stderr, flush=True)
                os._exit(128 + self.signum)
            if self._busy:
                self._done.wait(PEER_POLL_S)
                continue
            left = self.grace_s - (time.monotonic() - self._last_progress)
            if left <= 0:
                # A peer is gone or stuck: the agreed step will never come. End as SIGTERM would have.
                print(f"{signal.Signals(self.signum).name}: no progress for {self.grace_s:g} s and no step "
                      "agreed with the other ranks (a peer is gone or stuck); exiting without a checkpoint",
                      file=sys.stderr, flush=True)
                os._exit(128 + self.signum)
            self._done.wait(min(left, PEER_POLL_S))

    def agreed(self, flag_sum: float) -> bool:
        """Called with the step's summed flag, the same on every rank: stop here?"""
        if flag_sum <= 0:
            return False
        self._done.set()
        return True

    def close(self) -> None:
        """After the last step: a SIGTERM from now on ends the process at once, as by default,
        and one already received lets the run finish (its end is as near as any agreed step)."""
        self._done.set()
        if self._installed:
            signal.set_wakeup_fd(self._old_wakeup)
            for s, h in self._previous.items():
                signal.signal(s, h)
            os.close(self._wakeup[1])  # the watcher reads EOF and ends
            self._installed = False
