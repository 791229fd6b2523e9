"""The run dir's layout: every name a stage reads or writes there, in one place.

    RUN_DIR/spec.json               the validated job spec (tandem train -> workers)
    RUN_DIR/from_plan.json          the plan the run's layout came from (tandem train --plan -> tandem diagnose)
    RUN_DIR/metrics.jsonl           rank 0's records, every attempt's, appended (see ``read_metrics``)
    RUN_DIR/result.json             the last finished attempt's result (also its ``end`` record)
    RUN_DIR/attempts.jsonl          one line per start of the run dir (attempt, pid, host, time, argv)
    RUN_DIR/.lock                   the live `tandem train` that owns the run dir (see runlock.py)
    RUN_DIR/logs/rank-R[.attemptN][.restartK].log / .err.log    per-rank stdout / stderr
    RUN_DIR/errors/rank-R....json   torch's @record error files
    RUN_DIR/failures/node-I.json    each agent's failed ranks, merged by the parent
    RUN_DIR/heartbeat/rank-R.json   each rank's heartbeat page (core/heartbeat.py)
    RUN_DIR/watchdog/               hang reports, stacks and flight-recorder dumps
    RUN_DIR/checkpoints/step-N      DCP checkpoints (checkpoint.dir may put them elsewhere)
    RUN_DIR/samples/                sample traces (TANDEM_TRACE_SAMPLES=1)
    RUN_DIR/launch/node-I.json      the simulated nodes' agent configs
    RUN_DIR/profile/rank-R/         the step profiler's traces
    RUN_DIR/tensorboard/            TensorBoard scalars, when installed

Nothing here imports torch or another tandem stage: ``launch`` (the agents) and ``train``
(the workers) both read it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

SPEC = "spec.json"
FROM_PLAN = "from_plan.json"
METRICS = "metrics.jsonl"
RESULT = "result.json"
ATTEMPTS = "attempts.jsonl"
LOCK = ".lock"
LOGS = "logs"
ERRORS = "errors"
FAILURES = "failures"
HEARTBEAT = "heartbeat"
WATCHDOG = "watchdog"
CHECKPOINTS = "checkpoints"
SAMPLES = "samples"
LAUNCH = "launch"
PROFILE = "profile"
TENSORBOARD = "tensorboard"
EXPORT = "export"


def read_metrics(run_dir: Path, all_attempts: bool = False) -> list[dict]:
    """The records of ``metrics.jsonl``: by default the current attempt's only (those after the
    last ``attempt`` record; a file written before attempts were marked counts as one), which is
    what a progress bar, a restart report or a stop message is about; ``all_attempts``: the
    whole history, ``attempt`` records included."""
    out = _read_jsonl(Path(run_dir) / METRICS)
    if all_attempts:
        return out
    last = max((i for i, r in enumerate(out) if r.get("kind") == "attempt"), default=-1)
    return out[last + 1:]


def attempts(run_dir: Path) -> list[dict]:
    """Every start of this run dir so far, oldest first."""
    return _read_jsonl(Path(run_dir) / ATTEMPTS)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now, or cut by a kill
            pass
    return out


def begin_attempt(run_dir: Path, argv: list[str] | None = None) -> dict:
    """Record a new start of the run dir and return its record (attempt 1, 2, ...). Appended,
    never rewritten: the run's history of starts survives every rerun and resume."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    before = attempts(run_dir)
    # a run dir from before attempts were recorded holds attempt 1
    n = (before[-1]["attempt"] if before else int((run_dir / METRICS).is_file())) + 1
    rec = {"attempt": n, "time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
           "argv": list(argv if argv is not None else sys.argv)}
    with open(run_dir / ATTEMPTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


# The run attempt of another node of a static multi-node job on a shared run dir (Slurm, a TrainJob's
# pods): node 0's, read when the workers start (launch/logs.py). Node 0 records its start before its
# agent hosts the rendezvous, and workers start only after the rendezvous; read at this node's own
# start, a requeue (every node starting at once) could find the previous attempt and overwrite its logs.
NODE0_ATTEMPT = 0


def start_attempt(run_dir: Path, resume: Path | None = None) -> int:
    """A new start of the run dir by the job's driver (`tandem train`, `tandem submit --on ray`): recorded
    in ATTEMPTS and marked in METRICS by an ``attempt`` record, after which the workers append theirs.
    The previous RESULT is the ``end`` record of its attempt, in METRICS: removed, so that it is never
    read as this attempt's."""
    rec = begin_attempt(run_dir)
    with open(Path(run_dir) / METRICS, "a") as f:
        f.write(json.dumps({"kind": "attempt", **{k: v for k, v in rec.items() if k != "argv"},
                            "resume": str(resume) if resume else None}) + "\n")
    (Path(run_dir) / RESULT).unlink(missing_ok=True)
    return rec["attempt"]


def log_tag(rank: int | str, attempt: int, restart: int, agent_tag: str = "") -> str:
    """A rank's log/error-file stem: the first attempt keeps the plain names, a later start of
    the run dir gets ``.attemptN`` so that nothing of an earlier one is overwritten."""
    return (f"rank-{rank}{agent_tag}" + (f".attempt{attempt}" if attempt > 1 else "")
            + (f".restart{restart}" if restart else ""))
