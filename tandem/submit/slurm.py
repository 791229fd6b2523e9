"""`tandem submit --on slurm`: write an sbatch script that runs `tandem launch` once per node, submit it.

    job = SlurmJob(run_dir=Path("runs/x"), command=["examples/hello_dist.py"], nodes=2, nproc_per_node=2)
    text = render_sbatch(job)           # the script, as RUN_DIR/submit/job.sbatch will hold it
    job_id, text = submit(job)          # checks, writes job.sbatch + job.json, `sbatch --parsable`
    slurm_status(run_dir) / slurm_cancel(run_dir)
    SlurmBackend                        # the same, as backend.py's interface

The batch script runs on the job's first node. It finds the rendezvous there (that node's
address as Slurm reaches it, a free port on it), exports MASTER_ADDR/MASTER_PORT, and starts
one `tandem launch` per node with `srun --kill-on-bad-exit=1`; each agent reads its node rank
and the node count from Slurm's env (launch/slurm_env.py) and starts nproc_per_node workers. The
interpreter is the absolute path of the one that submitted, so every node runs this tandem.

Preemption and time limits: with ``max_requeues`` > 0 the job is ``--requeue``-able, and a
run that stopped on SIGTERM (exit 143: tandem train saved a checkpoint on the way out)
requeues itself with ``scontrol requeue`` while SLURM_RESTART_COUNT is under the limit (Slurm
marks a job that saved and exited during its grace time FAILED, not requeued). ``signal_s``
asks Slurm for SIGTERM that many seconds before the time limit, so a time limit takes the
same path.
"""

from __future__ import annotations

import datetime as dt
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from tandem.core.errors import ConfigError, LaunchError
from tandem.launch import failures as fl
from tandem.submit.backend import Status, SubmitFlags, Submitted
from tandem.submit.record import read_record, write_record

TIME = re.compile(r"^(\d+|\d+:\d{2}(:\d{2})?|\d+-\d+(:\d{2}){0,2})$")
# the states `tandem status` exits 1 on: the job ended badly (PREEMPTED is on its way to a requeue)
ENDED_BADLY = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


@dataclass
class SlurmJob:
    run_dir: Path
    command: list[str]                  # SCRIPT args... (tandem launch) or CONFIG overrides... (tandem train)
    train: bool = False                 # command is a job spec for `tandem train`
    nodes: int = 1
    nproc_per_node: int = 1
    partition: str = ""
    time: str = ""                      # Slurm's --time: minutes, H:MM:SS, D-HH...
    job_name: str = "tandem"
    max_requeues: int = 0
    signal_s: int = 0                   # SIGTERM this many seconds before the time limit (0: none)
    cpus_per_task: int = 0
    gpus_per_node: int = 0
    sbatch_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    workdir: Path = field(default_factory=Path.cwd)


def check(job: SlurmJob) -> None:
    """Every bad value is one line, before anything is written or submitted."""
    if job.nodes < 1:
        raise ConfigError("must be at least 1", field="--nodes", value=job.nodes, fix="use 1 or more nodes")
    if job.nproc_per_node < 1:
        raise ConfigError("must be at least 1", field="--nproc-per-node", value=job.nproc_per_node,
                          fix="use 1 or more workers per node")
    if job.time and not TIME.match(job.time):
        raise ConfigError("not a Slurm time", field="--time", value=job.time,
                          fix="use minutes (30), H:MM:SS (1:30:00) or D-HH (2-12)")
    if job.max_requeues < 0 or job.signal_s < 0:
        raise ConfigError("must not be negative", field="--max-requeues" if job.max_requeues < 0 else "--signal-s",
                          value=min(job.max_requeues, job.signal_s), fix="use 0 or more")
    if not job.command:
        raise ConfigError("nothing to run", field="script", fix="give a Python script or a job spec (.toml/.yaml)")
    target = Path(job.command[0])
    if job.command[0] != "-m" and not (job.workdir / target).is_file():
        raise ConfigError("file not found", field="script", value=job.command[0],
                          fix="give the path of a Python script or a job spec, relative to this folder")


def _q(argv: list[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def _abs_run_dir(job: SlurmJob) -> Path:
    return job.run_dir if job.run_dir.is_absolute() else job.workdir / job.run_dir


def tandem_argv(job: SlurmJob) -> list[str]:
    """What each node's task runs (node rank, nodes and master come from Slurm's env at run time)."""
    run_dir = str(_abs_run_dir(job))
    if job.train:
        return [job.python, "-m", "tandem", "train", *job.command, "--launch.nproc_per_node", str(job.nproc_per_node),
                "--launch.nnodes", str(job.nodes), "--launch.simulate_nodes", "0", "--launch.run_dir", run_dir,
                "--stream"]
    return [job.python, "-m", "tandem", "launch", "--nproc-per-node", str(job.nproc_per_node), "--run-dir", run_dir,
            *job.command]


def render_sbatch(job: SlurmJob, *, dry_run: bool = False) -> str:
    sub = _abs_run_dir(job) / "submit"
    # a dry run writes nothing (as the k8s and ssh ones): its first comment says where the real run puts it
    head = (f"# Dry run of `tandem submit --on slurm`: nothing written; without --dry-run this script goes to "
            f"{sub}/job.sbatch and to sbatch" if dry_run else
            f"# Written by `tandem submit --on slurm`; submit it again with: sbatch {sub}/job.sbatch")
    directives = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
                  f"--output={sub}/slurm-%j.out", "--open-mode=append"]
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.time:
        directives.append(f"--time={job.time}")
    if job.cpus_per_task:
        directives.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.max_requeues:
        directives.append("--requeue")
    if job.signal_s:
        directives.append(f"--signal=TERM@{job.signal_s}")
    directives += job.sbatch_args
    py = shlex.quote(job.python)
    train_args = ""
    if job.train:  # tandem train takes the node rank and master as spec overrides, read on each node
        train_args = (" --launch.node_rank \"$SLURM_NODEID\" --launch.master_addr \"$MASTER_ADDR\""
                      " --launch.master_port \"$MASTER_PORT\"")
    run = _q(tandem_argv(job))
    step = (f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'exec \"$@\"{train_args}' tandem {run}"
            if job.train else f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {run}")
    lines = ["#!/bin/bash",
             head,
             *(f"#SBATCH {d}" for d in directives),
             "",
             "set -u",
             "# A SIGTERM to this shell (preemption) must not end it before the step has saved and exited:",
             "# bash runs the trap once srun returns (children keep the default action).",
             "trap 'echo \"tandem: batch script got SIGTERM; waiting for the step\"' TERM",
             f"cd {shlex.quote(str(job.workdir))}",
             "# The rendezvous lives on this (the first) node: its address as Slurm reaches it, a free port here.",
             f"export MASTER_ADDR=$({py} -m tandem.launch.slurm_env master-addr) || exit 1",
             f"export MASTER_PORT=$({py} -m tandem.launch.slurm_env free-port) || exit 1",
             'echo "tandem: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST,'
             ' rendezvous $MASTER_ADDR:$MASTER_PORT"',
             step,
             "rc=$?",
             ]
    if job.max_requeues:
        lines += ["# Stopped by SIGTERM (preemption, --signal before the time limit) after saving: requeue, so",
                  "# that the next start resumes from the checkpoint, while under the limit.",
                  "# A worker that failed on its own leaves failures/node-K.json (then SIGTERM reaches the other",
                  "# nodes through --kill-on-bad-exit and srun says 143 too): that is a failure, not a preemption.",
                  f'failed=$(ls {shlex.quote(str(_abs_run_dir(job)))}/failures/node-*.json 2>/dev/null)',
                  f'if [ "$rc" -eq 143 ] && [ -z "$failed" ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {job.max_requeues} ]; then',
                  '    echo "tandem: stopped by SIGTERM (exit 143); requeueing job $SLURM_JOB_ID"',
                  '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
                  "fi",
                  f'if [ "$rc" -eq 143 ]; then echo "tandem: stopped by SIGTERM, requeue limit {job.max_requeues} '
                  'reached"; fi']
    lines += ["exit $rc", ""]
    return "\n".join(lines)


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise LaunchError(f"{tool} is not on PATH", field="--on", value="slurm",
                          fix=f"run on a Slurm login node (where `{tool}` works), or use --dry-run to see the script")
    return path


def _check_partition(partition: str) -> None:
    r = subprocess.run([_need("sinfo"), "-h", "-o", "%R"], capture_output=True, text=True, timeout=60)
    known = sorted(set(r.stdout.split()))
    if r.returncode == 0 and partition not in known:
        raise ConfigError("no such partition", field="--partition", value=partition,
                          fix=f"use one of {', '.join(known) or '(none listed by sinfo)'}")


def submit(job: SlurmJob, *, dry_run: bool = False) -> tuple[str | None, str]:
    """(job id or None on a dry run, the script). Writes RUN_DIR/submit/job.sbatch and job.json."""
    check(job)
    text = render_sbatch(job, dry_run=dry_run)
    if dry_run:
        return None, text
    sbatch = _need("sbatch")
    if job.partition:
        _check_partition(job.partition)
    sub = _abs_run_dir(job) / "submit"
    sub.mkdir(parents=True, exist_ok=True)
    script = sub / "job.sbatch"
    script.write_text(text)
    r = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120,
                       cwd=job.workdir)
    if r.returncode != 0:
        msg = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise LaunchError(f"sbatch refused the job: {msg}", field="--on", value="slurm",
                          fix=f"fix what sbatch says; the script is {script}")
    job_id = r.stdout.strip().split(";")[0]
    record = {"engine": "slurm", "job_id": job_id, "script": str(script),
              "submitted": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              **{k: v for k, v in asdict(job).items() if k not in ("run_dir", "workdir")},
              "run_dir": str(job.run_dir), "workdir": str(job.workdir)}
    write_record(_abs_run_dir(job), record)
    return job_id, text


def job_fields(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o` as a dict, or None when the controller no longer knows the job."""
    r = subprocess.run([_need("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not r.stdout.strip():
        return None
    out: dict[str, str] = {}
    for tok in r.stdout.split():
        k, sep, v = tok.partition("=")
        if sep:
            out[k] = v
    return out


def slurm_record(run_dir: Path) -> dict | None:
    """The run record of a Slurm submission in RUN_DIR, or None (no record, or another engine's)."""
    try:
        rec = read_record(run_dir)
    except ConfigError:
        return None
    return rec if rec.get("engine") == "slurm" else None


def slurm_job_end(rec: dict) -> str | None:
    """Why the Slurm job of run record REC is over, from its controller; None while it runs or waits."""
    f = job_fields(rec["job_id"])
    if f is None:
        return f"slurm job {rec['job_id']} is no longer known to the controller"
    state = f.get("JobState", "?")
    # a preempted job that will be requeued is not over
    if state in TERMINAL and not (state == "PREEMPTED"
                                  and int(f.get("Restarts", "0")) < int(rec.get("max_requeues", 0))):
        return f"slurm job {rec['job_id']} {state}"
    return None


def slurm_status(run_dir: Path) -> tuple[str, str]:
    """(state, one line) for the job submitted into run_dir."""
    rec = read_record(run_dir)
    f = job_fields(rec["job_id"])
    if f is None:
        done = (Path(run_dir) / "result.json").is_file()
        return ("UNKNOWN", f"slurm job {rec['job_id']}: no longer known to the controller (finished over "
                           f"MinJobAge ago); {'result.json present' if done else 'no result.json in the run dir'}")
    state = f.get("JobState", "?")
    restarts = f.get("Restarts", "0")
    parts = [f"slurm job {rec['job_id']}: {state}"]
    if state == "PENDING":
        parts.append(f"reason {f.get('Reason', '?')}")
    else:
        parts.append(f"nodes {f.get('NodeList', '?')}")
    parts.append(f"requeued {restarts} time(s)")
    if state in TERMINAL:
        parts.append(f"exit {f.get('ExitCode', '?')}, run time {f.get('RunTime', '?')}")
    if state in ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"):
        parts.append(_why(Path(run_dir), f, rec))
    return state, "; ".join(p for p in parts if p)


def _why(run_dir: Path, f: dict[str, str], rec: dict) -> str:
    cause = fl.root_cause(fl.read_failures(run_dir))
    if cause is not None:
        return (f"root cause: rank {cause.rank} (node {cause.node}) exit {cause.exitcode}: {cause.message}; "
                f"log {run_dir / 'logs' / f'rank-{cause.rank}.err.log'}")
    if f.get("ExitCode", "").startswith("143:"):
        return (f"stopped by SIGTERM (preemption, or --signal before the time limit) with {f.get('Restarts', '0')} "
                f"requeue(s) done, limit --max-requeues {rec.get('max_requeues', 0)}")
    if f.get("Reason") and f["Reason"] != "None":
        return f"reason {f['Reason']}"
    return f"see {run_dir / 'submit'}/slurm-{f.get('JobId', '*')}.out"


def slurm_cancel(run_dir: Path) -> str:
    rec = read_record(run_dir)
    r = subprocess.run([_need("scancel"), rec["job_id"]], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise LaunchError(f"scancel failed: {r.stderr.strip()}", field="run_dir", value=str(run_dir),
                          fix="check the job id with `squeue`")
    return rec["job_id"]


class SlurmBackend:
    """`--on slurm`: an sbatch script; Slurm queues, places, signals and requeues it."""

    name = "slurm"

    def options(self, flags: SubmitFlags) -> SlurmJob:
        return SlurmJob(run_dir=flags.run_dir, command=flags.command, train=flags.train, nodes=flags.nodes,
                        nproc_per_node=flags.nproc_per_node, partition=flags.partition, time=flags.time,
                        job_name=flags.job_name, max_requeues=flags.max_requeues, signal_s=flags.signal_s,
                        cpus_per_task=flags.cpus_per_task, gpus_per_node=flags.gpus_per_node,
                        sbatch_args=[a if a.startswith("--") else f"--{a}" for a in flags.sbatch_args])

    def dry_run(self, options: SlurmJob) -> str:
        return submit(options, dry_run=True)[1]

    def submit(self, options: SlurmJob, console: Console) -> Submitted:
        job_id, _ = submit(options)
        sub = options.run_dir / "submit"
        return Submitted((f"submitted: slurm job {job_id} ({options.nodes} node(s) x {options.nproc_per_node} "
                          f"worker(s)); script {sub / 'job.sbatch'}; output {sub}/slurm-{job_id}.out",
                          f"  follow it: tandem status {options.run_dir}"))

    def status(self, run_dir: Path) -> Status:
        state, line = slurm_status(run_dir)
        return Status(state, line, ended_badly=state in ENDED_BADLY)

    def cancel(self, run_dir: Path) -> str:
        return f"cancelled: slurm job {slurm_cancel(run_dir)}"

    def logs(self, run_dir: Path) -> str | None:
        job_id = read_record(run_dir)["job_id"]
        return f"slurm job {job_id}: sbatch output in {Path(run_dir) / 'submit'}/slurm-{job_id}.out"
