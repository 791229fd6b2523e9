"""Starting worker modules through tandem's launcher (shared by `bench comm` and `doctor`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.core.errors import ConfigError, WorkerFailure
from tandem.core.spec import LaunchSpec
from tandem.core.validate import parse_nnodes
from tandem.launch.options import LaunchArgs


@dataclass
class WorkerLaunch(LaunchArgs):
    """The launcher options of a bench/doctor verb, validated with their flag names."""

    @classmethod
    def of(cls, args: LaunchArgs) -> "WorkerLaunch":
        return cls(**asdict(args))

    def spec(self) -> LaunchSpec:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("unknown device", field="--device", value=self.device, fix="auto | cpu | cuda")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError("unknown backend", field="--backend", value=self.backend, fix="auto | gloo | nccl")
        if self.nproc_per_node < 1:
            raise ConfigError("need at least one worker per node", field="--nproc-per-node",
                              value=self.nproc_per_node, fix="use 1 or more")
        parse_nnodes(self.nnodes)
        if self.simulate_nodes and self.nnodes != "1":
            raise ConfigError("give either --simulate-nodes or --nnodes", field="--simulate-nodes",
                              value=self.simulate_nodes, fix="drop --nnodes when simulating nodes")
        return self.launch_spec()

    def procs_on_this_host(self) -> int:
        return self.nproc_per_node * max(1, self.simulate_nodes)

    def is_result_node(self) -> bool:
        """Whether global rank 0 (which writes results) runs under this command."""
        # c10d rendezvous hands out ranks by arrival, so with several real nodes any node may hold it.
        if self.simulate_nodes or parse_nnodes(self.nnodes)[1] == 1:
            return True
        return not self.rdzv_endpoint and self.node_rank == 0


def run_module(wl: WorkerLaunch, module: str, args: list[str], run_dir: Path, *, quiet: bool = True) -> None:
    """``python -m module args...`` on every worker; WorkerFailure names the failing rank."""
    from tandem.launch.launcher import launch

    launch(wl.spec(), ["-m", module, *args], run_dir, quiet=quiet)


def read_result(path: Path, wl: WorkerLaunch) -> dict | None:
    """Rank 0's result file; None on a node that did not host rank 0 (multi-node static runs)."""
    if path.is_file():
        return json.loads(path.read_text())
    if not wl.is_result_node():
        return None
    raise WorkerFailure(f"the workers finished but rank 0 wrote no result at {path}",
                        fix=f"see the per-rank logs in {path.parent / 'logs'}")
