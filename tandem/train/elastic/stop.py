"""A graceful stop: on SIGTERM, checkpoint at a step every rank agrees on, then exit.

torchrun's agent stops its workers with SIGTERM and kills them 30 s later: when a node joins
(the group restarts at the larger world), when the agent itself is told to stop (a scheduler
preempting the job, Kubernetes evicting a pod, Ctrl-C) and when a worker failed. Without a
handler the worker dies at once and the restart redoes every step since the last periodic
checkpoint.

With ``elastic.save_on_term`` (on by default) the handler only raises a flag. The flag rides
on the step's loss all-reduce (``runtime.PendingSum``, already paid for), so one step later
every rank reads the same sum at the same step, saves the same checkpoint there and exits,
and the restart redoes no step. A SIGTERM that reaches one node only (one pod drained) stops
the whole group at one step just the same.

A rank that cannot reach that step (a peer died or hangs, so the all-reduce never returns)
must not hold the restart back for torchrun's 30 s: unless the agreed save has begun
``grace_s`` after the signal, a timer thread ends the process as SIGTERM would have.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Stopped(Exception):
    """The group stopped on SIGTERM after saving a checkpoint (``@record`` writes this to the
    rank's error file, so the failure summary says why the rank ended)."""


class StopRequest:
    def __init__(self, enabled: bool, grace_s: float = 10.0) -> None:
        self.flag = 0.0  # summed over ranks with the step's loss: > 0 means some rank was told to stop
        self.signal_time: float | None = None
        self.grace_s = grace_s
        self._agreed = threading.Event()
        self._installed = enabled and threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame) -> None:
        if self.signal_time is not None:
            return  # a second SIGTERM changes nothing: the save is coming or the timer ends us
        self.flag, self.signal_time = 1.0, time.time()
        threading.Thread(target=self._deadline, name="tandem-stop-deadline", daemon=True).start()

    def _deadline(self) -> None:
        if self._agreed.wait(self.grace_s):
            return
        # A peer is gone or stuck: the agreed step will never come. End as SIGTERM would have.
        print(f"SIGTERM: no step agreed with the other ranks within {self.grace_s:g} s (a peer is gone or "
              "stuck); exiting without a checkpoint", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    def agreed(self, flag_sum: float) -> bool:
        """Called with the step's summed flag, the same on every rank: stop here?"""
        if flag_sum <= 0:
            return False
        self._agreed.set()
        return True

    def close(self) -> None:
        """After the last step: a SIGTERM from now on ends the process at once, as by default,
        and one already received lets the run finish (its end is as near as any agreed step)."""
        self._agreed.set()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
