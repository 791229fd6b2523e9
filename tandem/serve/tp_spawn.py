"""Starting a tensor-parallel replica's ranks 1..N-1 (tp.py), kept free of torch: the replica calls it
before it imports torch itself, so the ranks' start-ups overlap and a restart costs about one
interpreter-and-torch start, not two in a row."""

from __future__ import annotations

import os
import subprocess
import sys


def spawn(export: str, tp: int, threads: int, slots: int) -> tuple[list[subprocess.Popen], dict]:
    """Ranks 1..tp-1, started before rank 0 has imported torch (the replica calls this first, so their
    start-up overlaps rank 0's: a restart is about one interpreter-and-torch start, not two)."""
    from tandem.launch import orphans
    from tandem.launch.launcher import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(tp)}
    # through tandem.launch.orphans, as torchrun's agent starts training workers: each rank dies
    # with rank 0 (PR_SET_PDEATHSIG), whatever rank 0 died of
    procs = [subprocess.Popen([sys.executable, *orphans.wrap(["-m", "tandem.serve.tp", export, "--threads",
                                                              str(threads), "--slots", str(slots)])],
                              env={**env, "RANK": str(r)}, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                              stderr=sys.stderr)
             for r in range(1, tp)]
    return procs, env
