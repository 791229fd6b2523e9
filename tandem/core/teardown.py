"""Close the default process group at the end of a worker: one helper for every entry point.

A rank that finished its last collective is not done with it: gloo's worker thread that ran
the op still holds it (and the op's tensors) until it loops back, and that thread must take
the GIL to drop a tensor Python also sees. If the main thread meanwhile leaves the script,
the interpreter is finalizing by the time the gloo thread asks for the GIL; Python then ends
that thread from inside a C++ destructor and the process dies with "terminate called without
an active exception" (SIGABRT), after a run that had succeeded (seen on rank 0 of 2-rank gloo
runs on a busy CPU machine, a few runs in a hundred: docs/bench.md; the core dump showed
~AsyncAllgatherWork -> take_gil -> pthread_exit while the main thread was in Py_FinalizeEx). ``destroy_process_group`` does not
stop those threads while anything (a DDP module) still holds the group.

So on success every rank meets in a barrier first (no rank closes its sockets while a peer is
still sending), then lets go of the GIL for ``DRAIN_S``: the barrier alone was not enough (runs
under load still aborted with it: docs/bench.md): when the peer is already waiting it completes in
microseconds, and the main thread takes the GIL back before a starved gloo thread gets it. A
sleep hands the GIL over, and a runnable thread gets a core within it on a machine loaded 5x
over. It is a margin, not a proof: torch offers no way to wait for gloo's threads to go idle
(``_wait_for_pending_works`` is NCCL-only); tandem's own workers also leave through
``os._exit`` (tandem/core/fastexit.py), where no finalization can race.
The barrier has a timeout: a peer that died after its last collective costs ``timeout_s``,
not the group's 30 minutes, and the rank goes on closing (its own work did succeed). On
failure there is no barrier: the peers may be gone or stuck in a collective, so the group is
destroyed at once, as before.

Imported by workers only (it imports torch).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch.distributed as dist

BARRIER_TIMEOUT_S = 60.0
DRAIN_S = 0.2  # GIL released, so that gloo's threads can drop the last ops' tensors


def close_process_group(ok: bool = True, timeout_s: float = BARRIER_TIMEOUT_S, drain_s: float = DRAIN_S) -> None:
    """Destroy the default process group, if any; on success (``ok``) after a barrier of every rank.
    ``drain_s=0`` for a process that leaves through ``os._exit``: no finalization follows to race."""
    if not dist.is_initialized():
        return
    if ok and dist.get_world_size() > 1:
        start = time.monotonic()
        try:
            # The op's own timeout too: a barrier left running in a gloo thread would block the
            # group's destruction (it joins that thread) until the group's timeout.
            limit = timedelta(seconds=timeout_s)
            dist.barrier(async_op=True, timeout=limit).wait(limit)
        except Exception as e:  # a peer gone or late: this rank's work is done all the same
            # the time it failed after, not the limit: a peer already gone fails it at once
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            print(f"warning: rank {dist.get_rank()}: the ranks did not meet before closing the process group: the "
                  f"barrier failed after {time.monotonic() - start:.2g} s (limit {timeout_s:g} s; {why}); closing "
                  "it anyway", file=sys.stderr, flush=True)
        time.sleep(drain_s)
    dist.destroy_process_group()
