"""Workers die with their parent: ``kill -9`` of `tandem train` (or of a node's agent) leaves
no worker training on with nobody watching it, still writing checkpoints into the run dir.

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) makes the kernel send a signal
to a process when its parent ends, whatever the parent died of. It has to be set by the
child itself and it survives ``execve``, so torchrun's agent starts every worker through
this module: ``python -m tandem.launch.orphans AGENT_PID python-args...`` sets it and
``exec``s the real worker in the same process (same pid, a few ms of interpreter start). The
signal is SIGKILL: with its agent gone, no peer can agree on a step to save at, and the
run dir's lock (core/runlock.py) is free once the owner is dead, so nothing of the job may
run on. The simulated nodes' agents (launch/node.py) set it for themselves in the same way.

Elsewhere than Linux ``die_with_parent`` does nothing (it returns False).
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel for ``sig`` when our parent ends; if ``parent_pid`` is already gone
    (it died before the request was made), end now. True where the kernel supports it."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:  # reparented already: the signal would never come
        os.kill(os.getpid(), sig)
    return True


def wrap(argv: list[str]) -> list[str]:
    """The agent's worker arguments (``python ARGV``) through this module."""
    return ["-m", "tandem.launch.orphans", str(os.getpid()), *argv]


def main(args: list[str]) -> None:
    die_with_parent(int(args[0]))
    os.execv(sys.executable, [sys.executable, *args[1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
