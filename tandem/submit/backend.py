"""The one interface every engine of `tandem submit` implements, and the typed messages it takes and gives.

    backend = BACKENDS[flags.on]            # registry.py
    options = backend.options(flags)        # the engine's own typed options (SlurmJob, K8sJob, SshJob, RayJob)
    print(backend.dry_run(options), end="") # --dry-run: what would be submitted; nothing is
    done = backend.submit(options, console) # Submitted: the lines to print, the exit code
    backend.status(run_dir)                 # Status, from RUN_DIR/submit/job.json and the engine
    backend.cancel(run_dir)                 # the line saying what was stopped
    backend.logs(run_dir)                   # where the engine kept output the rank logs do not hold

Batch engines (Slurm, Kubernetes) return from ``submit`` once the job is queued; ssh and Ray
run in the foreground (the submitting process drives the job) and return when it has ended,
with its exit code. A method an engine cannot do raises a TandemError that says what to do
instead, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from rich.console import Console

SPEC_SUFFIXES = (".toml", ".yaml", ".yml")  # a target with one of these is a job spec for `tandem train`

Options = TypeVar("Options")


@dataclass(frozen=True)
class SubmitFlags:
    """`tandem submit`'s flags as given; each engine reads the ones that are its own."""
    target: str                         # a script (`tandem launch` on every node) or a job spec (`tandem train`)
    args: tuple[str, ...] = ()          # what follows the target: the script's args or the spec's overrides
    run_dir: Path = Path("runs/submit")
    nodes: int = 1
    nproc_per_node: int = 1
    nodes_given: bool = False           # ssh: without --nodes / --nproc-per-node every host runs its slots
    nproc_given: bool = False
    job_name: str = "tandem"
    max_requeues: int = 0
    cpus_per_task: int = 0
    gpus_per_node: int = 0
    # slurm
    partition: str = ""
    time: str = ""
    signal_s: int = 0
    sbatch_args: tuple[str, ...] = ()
    # k8s
    image: str = ""
    kind: str = "jobset"
    namespace: str = "default"
    queue: str = ""
    pvc: str = ""
    volumes: tuple[str, ...] = ()
    shm_size: str = "8Gi"
    memory: str = ""
    # ssh
    hostfile: Path | None = None
    env: tuple[str, ...] = ()
    ssh_config: str = ""
    master_port: int = 29500
    watchdog_s: float = 0
    # ray
    address: str = ""
    workers: int = 0
    max_failures: int = 0

    @property
    def command(self) -> list[str]:
        return [self.target, *self.args]

    @property
    def train(self) -> bool:
        return self.target.endswith(SPEC_SUFFIXES)


@dataclass(frozen=True)
class Submitted:
    """What `tandem submit` prints once the engine has the job (or, in the foreground, once it ended)."""
    lines: tuple[str, ...] = ()         # rich markup: `[green]done[/]`
    exit_code: int = 0


@dataclass(frozen=True)
class Status:
    state: str                          # the engine's word: PENDING, RUNNING, COMPLETED, FAILED, LOST...
    line: str                           # one line for a person (plain text: reasons hold [file:line])
    ended_badly: bool = False           # `tandem status` exits 1, so a script can test it like the job itself


class Backend(Protocol[Options]):
    """One engine. Stateless: everything about a job is in its options or its run dir's record."""

    name: str

    def options(self, flags: SubmitFlags) -> Options:
        """The engine's typed options from the flags (no check yet: dry_run and submit check)."""
        ...

    def dry_run(self, options: Options) -> str:
        """Every check that needs no cluster, then the text of what would be submitted."""
        ...

    def submit(self, options: Options, console: Console) -> Submitted:
        """Every check, then the job handed to the engine; RUN_DIR/submit/job.json written."""
        ...

    def status(self, run_dir: Path) -> Status:
        ...

    def cancel(self, run_dir: Path) -> str:
        ...

    def logs(self, run_dir: Path) -> str | None:
        """One line on where the engine kept its own output, when the run dir's rank logs are not all of it."""
        ...
