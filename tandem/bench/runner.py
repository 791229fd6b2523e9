"""Starting worker modules through tandem's launcher (shared by `bench comm` and `doctor`)."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.core.errors import WorkerFailure
from tandem.core.spec import LaunchSpec


def procs_on_this_host(launch: LaunchSpec) -> int:
    return launch.nproc_per_node * max(1, launch.simulate_nodes)


def is_result_node(launch: LaunchSpec) -> bool:
    """Whether global rank 0 (which writes results) runs under this command."""
    # c10d rendezvous hands out ranks by arrival, so with several real nodes any node may hold it.
    if launch.simulate_nodes or launch.nodes.max == 1:
        return True
    return not launch.rdzv_endpoint and launch.node_rank == 0


def run_module(launch: LaunchSpec, module: str, args: list[str], run_dir: Path, *, quiet: bool = True) -> None:
    """``python -m module args...`` on every worker (``launch`` validated); WorkerFailure names the failing rank."""
    from tandem.launch.launcher import launch as start

    start(launch, ["-m", module, *args], run_dir, quiet=quiet)


def read_result(path: Path, launch: LaunchSpec) -> dict | None:
    """Rank 0's result file; None on a node that did not host rank 0 (multi-node static runs)."""
    if path.is_file():
        return json.loads(path.read_text())
    if not is_result_node(launch):
        return None
    raise WorkerFailure(f"the workers finished but rank 0 wrote no result at {path}",
                        fix=f"see the per-rank logs in {path.parent / 'logs'}")
