"""`tandem launch [opts] script.py args...`: a drop-in for torchrun with tandem's logs and summary."""

from __future__ import annotations

from pathlib import Path

import typer

from tandem.cli.passthrough import refuse_unknown_option
from tandem.core.console import make_console
from tandem.core.errors import ConfigError, WorkerFailure
from tandem.core.spec import LaunchSpec
from tandem.launch import failures as fl
from tandem.launch.cluster_env import from_cluster
from tandem.launch.launcher import launch as run_launch
from tandem.launch.options import check, launch_options


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

    Options before SCRIPT are tandem launch's; everything after SCRIPT (or after --) goes to the script.

    Example: tandem launch --nproc-per-node 2 --simulate-nodes 2 examples/hello_dist.py
    """
    refuse_unknown_option(ctx, script, "launch", allowed=("-m",))  # before anything starts or is written
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
