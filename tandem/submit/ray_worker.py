"""What runs inside each of Ray Train's workers for `tandem submit --on ray`: tandem's worker, handed over by name.

    TorchTrainer(ray_worker, train_loop_config={..., "entry": WORKER_ENTRY})   # ray_driver.py

The contract with the train stage is an entry name, as torchrun is given ``-m tandem.train.worker``
by `tandem train`: ``MODULE:FUNCTION``, called as ``FUNCTION(run_dir)`` in a process whose torch
process group Ray has formed and whose environment says the rank, the world, the device and the
backend (``ClusterEnv`` reads it, core/environment.py); RUN_DIR/spec.json holds the job. The
function returns when the rank is done (it must not leave the process: the worker is Ray's actor)
and raises on a failure, which is how Ray Train learns to restart the group. The submit stage sits
below train and never imports it: the name is resolved here, in Ray's worker process, at run time.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from pathlib import Path
from typing import Callable

from tandem.core import rundir
from tandem.core.contract import AGENT_STARTS_ENV
from tandem.core.environment import ENV_BACKEND, ENV_DEVICE

WORKER_ENTRY = "tandem.train.worker:main"   # `tandem train`'s worker: `python -m tandem.train.worker RUN_DIR`
RAY_DIR = "ray"            # RUN_DIR/ray/: Ray Train's own storage (RunConfig.storage_path) and start files


def resolve(entry: str) -> Callable[[str], None]:
    """``MODULE:FUNCTION`` to the function (importing MODULE in this process)."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name or "main")


def ray_worker(config: dict) -> None:
    """Ray Train's training function: one tandem worker, with the rank and world Ray gave it."""
    import ray  # deferred: Ray is the optional `ray` extra, and this module is imported by the driver's checks
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    run = Path(config["run_dir"])
    # This rank's starts so far, on shared storage: a restarted group is attempt K for the log names,
    # the restart report and the fault injection (the group agrees on the maximum, resume.agree_attempt).
    starts_file = run / RAY_DIR / "starts" / f"rank-{rank}"
    starts_file.parent.mkdir(parents=True, exist_ok=True)
    starts = len(starts_file.read_text().splitlines()) if starts_file.is_file() else 0
    with open(starts_file, "a") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    # intra-op threads: the spec's, else the CPUs Ray gave this worker (never an OMP_NUM_THREADS the raylet
    # inherited from whoever started it: the sums, and so the bits, depend on the thread count)
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU") or 1
    os.environ["OMP_NUM_THREADS"] = str(config.get("threads") or max(1, int(cpus)))
    os.environ.update({ENV_DEVICE: config["device"], ENV_BACKEND: config["backend"], AGENT_STARTS_ENV: str(starts),
                       "TORCHELASTIC_RUN_ID": config["run_id"], "PYTHONUNBUFFERED": "1"})
    tag = rundir.log_tag(rank, config["attempt"], starts)
    for d in (rundir.LOGS, rundir.ERRORS):
        (run / d).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(run / rundir.ERRORS / f"{tag}.json")
    main = resolve(config.get("entry") or WORKER_ENTRY)
    # the rank's output in the run dir, as under `tandem launch` (Ray's own worker logs stay Ray's)
    with _redirect(1, run / rundir.LOGS / f"{tag}.log"), _redirect(2, run / rundir.LOGS / f"{tag}.err.log"):
        main(str(run))


class _redirect:
    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    def __enter__(self) -> None:
        sys.stdout.flush(), sys.stderr.flush()
        self.saved = os.dup(self.fd)
        with open(self.path, "a") as f:
            os.dup2(f.fileno(), self.fd)

    def __exit__(self, *exc) -> None:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(self.saved, self.fd)
        os.close(self.saved)
