"""`tandem doctor`: a pass / warn / fail preflight of this node (and every node through the launcher).

The checks are tandem/diagnose/'s (doctor.py); here the flags, the table and the exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from tandem.bench.runner import procs_on_this_host
from tandem.core.spec import LaunchSpec
from tandem.core.units import parse_size
from tandem.diagnose.checks import FAIL, Check, ChecksFailed, print_summary, table, worst
from tandem.diagnose.doctor import expected_busbw, local_checks, nccl_log_checks, run_workers
from tandem.diagnose.options import DoctorOptions
from tandem.launch.options import check, launch_options


def _emit(checks: list[Check], json_out: Optional[Path], title: str, extra: dict | None = None) -> None:
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table(checks, title=title))
    print_summary(checks, console)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"status": worst(checks), **(extra or {}),
                                        "checks": [c.to_dict() for c in checks]}, indent=1))
    failed = [c for c in checks if c.status == FAIL]
    if failed:
        # An exception, not typer.Exit: `tandem` runs typer with standalone_mode=False,
        # where an Exit's code would be dropped.
        names = ", ".join(dict.fromkeys(f"{c.name}" + (f" ({c.node})" if c.node else "") for c in failed))
        raise ChecksFailed(f"{len(failed)} check(s) failed: {names}", fix="apply the fixes in the table above")


def nccl_log_report(path: Path, json_out: Optional[Path]) -> None:
    checks, extra = nccl_log_checks(path)
    _emit(checks, json_out, f"NCCL log: {path}", extra)


@launch_options("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint",
                "simulate_nodes", "timeout", "device",
                nproc_per_node=(0, "Workers per node (0: GPUs, or 2 on CPU)."),
                nnodes=("1", "Nodes (run `tandem doctor` on each)."),
                timeout=(30, "Seconds to wait for every node to join."))
def doctor_cmd(
    nccl_log_file: Optional[Path] = typer.Option(None, "--nccl-log",
                                                 help="Summarise an NCCL_DEBUG=INFO log instead of checking."),
    launch: LaunchSpec = None,
    checkpoint_path: Path = typer.Option(Path("runs"), "--checkpoint-path", help="Where checkpoints will go."),
    shared_path: Optional[Path] = typer.Option(None, "--shared-path",
                                               help="Path that must be shared by all nodes (default: "
                                                    "--checkpoint-path)."),
    expect_busbw: float = typer.Option(0.0, "--expect-busbw", help="Expected all_reduce busbw in GB/s."),
    calibration: Optional[Path] = typer.Option(None, "--calibration",
                                               help="Take the expected busbw from this calibration file."),
    busbw_size: str = typer.Option("8M", "--busbw-size", help="Message size of the quick all_reduce."),
    local_only: bool = typer.Option(False, "--local", help="Only this machine's checks; start no workers."),
    run_dir: Path = typer.Option(Path("runs/doctor"), "--run-dir", help="Worker logs go here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the checks as JSON."),
) -> None:
    """Preflight a (multi-node) job: versions, GPUs, /dev/shm, limits, network, storage, clocks, all_reduce.

    Exits 1 when any check fails. Example: tandem doctor --simulate-nodes 2 --nproc-per-node 2
    """
    if nccl_log_file is not None:
        nccl_log_report(nccl_log_file, json_out)
        return
    device, simulate_nodes, timeout = launch.device, launch.simulate_nodes, launch.timeout_s
    if launch.nproc_per_node == 0:
        import torch

        launch.nproc_per_node = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 2
    nproc_per_node = launch.nproc_per_node
    wl = check(launch)
    from tandem.core.validate import node_counts

    opts = DoctorOptions(device=device, nproc_per_node=nproc_per_node, checkpoint_path=str(checkpoint_path),
                         shared_path=str(shared_path or ""), busbw_bytes=parse_size(busbw_size, "--busbw-size"),
                         collective_timeout_s=max(60.0, 4.0 * timeout),
                         expect_busbw_GBps=expected_busbw(expect_busbw, calibration,
                                                           node_counts(wl).max))
    checks = local_checks(opts, wl)
    if local_only:
        _emit(checks, json_out, "tandem doctor (this machine only)")
        return
    workers = run_workers(opts, wl, run_dir)
    if isinstance(workers, Check):  # the workers did not run: this machine's view plus why
        _emit(checks + [workers], json_out, "tandem doctor")
    elif workers is None:
        _emit(checks, json_out, "tandem doctor (this node; the full table prints on the node with rank 0)")
    else:
        _emit(workers, json_out, f"tandem doctor ({procs_on_this_host(wl) if simulate_nodes else nproc_per_node} "
                                 f"workers per {'machine' if simulate_nodes else 'node'})")
