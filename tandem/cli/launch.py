"""`tandem launch [opts] script.py args...`: a drop-in for torchrun with tandem's logs and summary."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import typer

from tandem.core.console import make_console
from tandem.core.environment import from_kubeflow
from tandem.core.errors import ConfigError, WorkerFailure
from tandem.core.spec import LaunchSpec
from tandem.launch import failures as fl
from tandem.launch.launcher import launch as run_launch
from tandem.launch.options import check, launch_options
from tandem.launch.slurm_env import slurm_env, slurm_rendezvous


@launch_options("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint",
                "simulate_nodes", "max_restarts", "timeout", "watchdog_s", "last_call_s", "device", "backend",
                "threads", simulate_nodes=(0, "K real agents on this machine (c10d)."),
                timeout=(60, "Seconds to wait for the rendezvous / master."))
def launch_cmd(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Python script (or -m module) to run on every worker."),
    launch: LaunchSpec = None,
    run_dir: Path = typer.Option(Path("runs/launch"), "--run-dir", help="Logs and failure records go here."),
    quiet: bool = typer.Option(False, "--quiet", help="Per-rank files only, no console stream."),
    verbose: bool = typer.Option(False, "--verbose", help="Show torch's own logs (torchrun's agent, c10d's "
                                                          "C++ store retries)."),
    cluster: str = typer.Option("auto", "--cluster", help="auto: inside an `srun` step (one task per node) or a "
                                                          "Kubeflow pod (PET_* env) take nodes, node rank and "
                                                          "master from the scheduler's env; none: never."),
) -> None:
    """Run SCRIPT on every worker through torchrun's elastic agent.

    Example: tandem launch --nproc-per-node 2 --simulate-nodes 2 examples/hello_dist.py
    """
    if cluster not in ("auto", "none"):
        raise ConfigError(f"{cluster!r} is not one of auto, none", field="--cluster", value=cluster, fix="use auto")
    if cluster == "auto":
        launch = from_cluster(launch)
    opts = check(launch)
    argv = ["-m", *ctx.args] if script == "-m" else [script, *ctx.args]
    console = make_console(stderr=True)
    try:
        run_launch(opts, argv, run_dir, quiet=quiet, verbose=verbose)
    except WorkerFailure:
        fl.render(fl.read_failures(run_dir), console)
        raise
    console.print(f"[green]ok[/]: all workers finished; per-rank logs in {run_dir / 'logs'}", highlight=False)


def from_cluster(launch: LaunchSpec, env=os.environ) -> LaunchSpec:
    """Inside a Slurm step or a Kubeflow pod (PET_*), fill nodes, node rank and master from the scheduler's
    env (flags the user gave win)."""
    given = launch.nnodes != "1" or launch.node_rank or launch.rdzv_endpoint or launch.simulate_nodes
    job = None if given else slurm_env(env)
    if job is None and not given:
        return _from_kubeflow(launch, env)
    if job is None or job.nnodes == 1:  # one node: the private standalone store is the better rendezvous
        return launch
    rdzv = slurm_rendezvous(env)
    if rdzv is None:
        return launch
    addr = launch.master_addr if launch.master_addr != "127.0.0.1" else rdzv.master_addr
    port = launch.master_port if launch.master_port != 29500 else rdzv.master_port
    return dataclasses.replace(launch, nnodes=str(rdzv.nnodes), node_rank=rdzv.node_rank, master_addr=addr,
                               master_port=port)


def _from_kubeflow(launch: LaunchSpec, env) -> LaunchSpec:
    node = from_kubeflow(env)
    if node is None:
        return launch
    nproc = node.nproc_per_node if node.nproc_per_node and launch.nproc_per_node == 1 else launch.nproc_per_node
    if node.nnodes == 1:  # one node: the private standalone store is the better rendezvous
        return dataclasses.replace(launch, nproc_per_node=nproc)
    addr = launch.master_addr if launch.master_addr != "127.0.0.1" else node.master_addr
    port = launch.master_port if launch.master_port != 29500 else node.master_port
    return dataclasses.replace(launch, nproc_per_node=nproc, nnodes=str(node.nnodes), node_rank=node.node_rank,
                               master_addr=addr, master_port=port)
