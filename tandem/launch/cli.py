"""`tandem launch [opts] script.py args...`: a drop-in for torchrun with tandem's logs and summary."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from tandem.core.errors import ConfigError, WorkerFailure
from tandem.core.spec import LaunchSpec
from tandem.core.validate import parse_nnodes
from tandem.launch import failures as fl
from tandem.launch.launcher import launch


def launch_cmd(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Python script (or -m module) to run on every worker."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Workers per node."),
    nnodes: str = typer.Option("1", "--nnodes", help="Nodes, or MIN:MAX for elastic jobs."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's rank (static rendezvous)."),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr", help="Address of node 0."),
    master_port: int = typer.Option(29500, "--master-port", help="Rendezvous port on node 0."),
    rdzv_endpoint: str = typer.Option("", "--rdzv-endpoint", help="host:port of a c10d rendezvous."),
    simulate_nodes: int = typer.Option(0, "--simulate-nodes", help="K real agents on this machine (c10d)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Restarts of the worker group on failure."),
    timeout: int = typer.Option(60, "--timeout", help="Seconds to wait for the rendezvous / master."),
    watchdog_s: float = typer.Option(0, "--watchdog-s", help="Hang watchdog: end the group when a rank that "
                                                              "writes heartbeats stalls this long (0: off)."),
    last_call_s: int = typer.Option(3, "--last-call-s", help="Elastic MIN:MAX: wait this long for more nodes "
                                                              "once MIN joined."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    backend: str = typer.Option("auto", "--backend", help="auto | gloo | nccl."),
    threads: int = typer.Option(0, "--threads-per-worker", help="Intra-op threads (0: cores / workers)."),
    run_dir: Path = typer.Option(Path("runs/launch"), "--run-dir", help="Logs and failure records go here."),
    quiet: bool = typer.Option(False, "--quiet", help="Per-rank files only, no console stream."),
    verbose: bool = typer.Option(False, "--verbose", help="Show torchrun's own logs."),
) -> None:
    """Run SCRIPT on every worker through torchrun's elastic agent.

    Example: tandem launch --nproc-per-node 2 --simulate-nodes 2 examples/hello_dist.py
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{device!r} is not one of auto, cpu, cuda", field="--device", fix="use auto")
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"{backend!r} is not one of auto, gloo, nccl", field="--backend", fix="use auto")
    if nproc_per_node < 1:
        raise ConfigError(f"must be at least 1, got {nproc_per_node}", field="--nproc-per-node", fix="use 1 or more")
    parse_nnodes(nnodes)
    if simulate_nodes and nnodes != "1" and parse_nnodes(nnodes)[1] != simulate_nodes:
        raise ConfigError(f"--nnodes {nnodes} does not fit --simulate-nodes {simulate_nodes}", field="--nnodes",
                          value=nnodes, fix=f"drop --nnodes, or give MIN:{simulate_nodes} for an elastic job")
    opts = LaunchSpec(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                      master_port=master_port, rdzv_endpoint=rdzv_endpoint, simulate_nodes=simulate_nodes,
                      max_restarts=max_restarts, timeout_s=timeout, device=device, backend=backend,
                      threads_per_worker=threads, watchdog_s=watchdog_s, last_call_s=last_call_s)
    argv = ["-m", *ctx.args] if script == "-m" else [script, *ctx.args]
    console = Console(stderr=True)
    try:
        launch(opts, argv, run_dir, quiet=quiet, verbose=verbose)
    except WorkerFailure:
        fl.render(fl.read_failures(run_dir), console)
        raise
    console.print(f"[green]ok[/]: all workers finished; per-rank logs in {run_dir / 'logs'}", highlight=False)
