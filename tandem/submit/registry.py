"""`--on NAME` to its engine, and a run dir's record to the engine that submitted it.

    backend = backend_named("slurm")        # one line naming the engines for any other name
    backend = backend_of(run_dir)           # from RUN_DIR/submit/job.json's ``engine``
"""

from __future__ import annotations

from pathlib import Path

from tandem.core.errors import ConfigError
from tandem.submit.backend import Backend
from tandem.submit.k8s import K8sBackend
from tandem.submit.ray_driver import RayBackend
from tandem.submit.record import read_record
from tandem.submit.slurm import SlurmBackend
from tandem.submit.ssh import SshBackend

BACKENDS: dict[str, Backend] = {"slurm": SlurmBackend(), "k8s": K8sBackend(), "ssh": SshBackend(),
                                "ray": RayBackend()}


def backend_named(name: str) -> Backend:
    if name not in BACKENDS:
        names = list(BACKENDS)
        raise ConfigError(f"{name!r} is not one of {', '.join(names)}", field="--on", value=name,
                          fix=f"use {', '.join(f'--on {n}' for n in names[:-1])} or --on {names[-1]}")
    return BACKENDS[name]


def backend_of(run_dir: Path, verb: str) -> Backend:
    """The engine that submitted the job in ``run_dir``; ``verb`` (status, cancel) names what was asked of it."""
    engine = read_record(run_dir).get("engine")
    if engine not in BACKENDS:
        raise ConfigError(f"{verb} of {engine} jobs is not implemented", field="run_dir", value=str(run_dir),
                          fix="ask the engine that ran it")
    return BACKENDS[engine]
