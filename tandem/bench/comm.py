"""`tandem bench comm`'s measurement: the options to the workers (comm_worker.py), rank 0's result back."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console

from tandem.bench.options import CommOptions
from tandem.bench.runner import procs_on_this_host, read_result, run_module
from tandem.core.environment import resolve_device
from tandem.core.spec import LaunchSpec

RESULT_FILE = "bench-comm.json"


def measure(opts: CommOptions, launch: LaunchSpec, run_dir: Path) -> dict | None:
    """Run the workers and return rank 0's result (None on nodes without rank 0)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    opts_path, res_path = run_dir / "bench-comm-options.json", run_dir / RESULT_FILE
    opts_path.write_text(json.dumps(opts.to_dict()))
    res_path.unlink(missing_ok=True)  # a stale file must never pass for this run's result
    with Console(stderr=True).status(f"measuring {', '.join(opts.collectives)} on "
                                     f"{procs_on_this_host(launch)} local workers ..."):
        run_module(launch, "tandem.bench.comm_worker",
                   ["--options", str(opts_path.resolve()), "--out", str(res_path.resolve())], run_dir)
    return read_result(res_path, launch)


def comm_workers(counts: list[int]) -> int:
    """Workers for the quick link measurement: two at least, but NCCL takes one rank per GPU, so on a
    host with one GPU there is no link to measure (the calibration then holds the host and compute)."""
    import torch  # only when the quick measurement runs: `tandem --help` stays torch-free

    n = max(2, max(counts))
    if resolve_device("auto", "auto", os.environ)[0] == "cuda":
        n = min(n, max(1, torch.cuda.device_count()))
    return n
