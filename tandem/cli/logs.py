"""`tandem logs RUN_DIR [--follow] [--rank R] [--attempt N]`: the job's rank logs, one stream (launch/log_reader.py)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import typer

from tandem.core import rundir
from tandem.core.errors import ConfigError
from tandem.launch.log_reader import RankLog, Tail, current_attempt, job_end, scan
from tandem.submit.slurm import slurm_job_end, slurm_record

POLL_S = 0.25  # how often --follow looks for new lines and for the job's end


def logs_cmd(
    run_dir: Path = typer.Argument(..., help="The run dir of a `tandem launch`, `tandem train` or `tandem submit`."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until the job ends."),
    rank: int = typer.Option(-1, "--rank", help="Only this global rank (default: every rank)."),
    attempt: int = typer.Option(0, "--attempt", help="This start of the run dir, 1 the first (default: the "
                                                     "current one)."),
) -> None:
    """Print the job's rank logs, each line prefixed with its rank; --follow until the job ends.

    Example: tandem logs runs/hello --rank 0 --follow
    """
    if not run_dir.is_dir():
        raise ConfigError("no such run dir", field="run_dir", value=str(run_dir),
                          fix="give the --run-dir of a `tandem launch`, `tandem train` or `tandem submit`")
    slurm = slurm_record(run_dir)
    if slurm is not None:
        print(f"slurm job {slurm['job_id']}: sbatch output in {run_dir / 'submit'}/slurm-{slurm['job_id']}.out",
              file=sys.stderr, flush=True)
    # a Slurm job's end is its controller's to say, where scontrol answers; else the run dir tells
    if slurm is not None and shutil.which("scontrol"):
        def ended_why() -> str | None:
            return slurm_job_end(slurm)
    else:
        def ended_why() -> str | None:
            return job_end(run_dir)
    files = scan(run_dir)
    current = current_attempt(run_dir, files)
    chosen = attempt or current
    if attempt and not 1 <= attempt <= current:
        raise ConfigError(f"the run dir has attempts 1 to {current}", field="--attempt", value=attempt,
                          fix=f"use 1 to {current}, or leave it out for the current one")
    ended = ended_why() if follow else "not followed"
    mine = [f for f in files if f.attempt == chosen]
    if not mine and ended is not None:  # nothing to print and nothing more will come
        if not files:
            raise ConfigError("no rank logs in the run dir", field="run_dir", value=str(run_dir),
                              fix=f"give the run dir of a job that has started (logs are in {rundir.LOGS}/rank-R.log)")
        have = sorted({f.attempt for f in files})
        raise ConfigError(f"attempt {chosen} has no rank logs", field="--attempt", value=chosen,
                          fix=f"use --attempt {' or '.join(map(str, have))}")
    ranks = sorted({f.rank for f in mine})
    if rank >= 0 and mine and rank not in ranks:
        raise ConfigError(f"no such rank in attempt {chosen}", field="--rank", value=rank,
                          fix=f"use one of {', '.join(map(str, ranks))}")

    def wanted(fs: list[RankLog]) -> list[RankLog]:
        keep = (lambda f: f.attempt >= chosen) if follow and not attempt else (lambda f: f.attempt == chosen)
        return [f for f in fs if keep(f) and (rank < 0 or f.rank == rank)]

    tail = Tail(chosen)
    if not follow:
        _emit(tail.read(wanted(mine), final=True))
        return
    while True:
        ended = ended_why()  # before reading: whatever was written before the end gets read
        _emit(tail.read(wanted(scan(run_dir)), final=ended is not None))
        if ended is not None:
            print(f"tandem logs: the job has ended ({ended})", file=sys.stderr, flush=True)
            return
        time.sleep(POLL_S)


def _emit(lines: list[str]) -> None:
    if lines:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
