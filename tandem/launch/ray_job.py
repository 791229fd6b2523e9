"""`tandem submit --on ray`: the worker loop as Ray Train's training function.

    job = RayJob(spec=spec, run_dir=Path("/shared/runs/x"), workers=2, max_failures=3)
    result = submit_ray(job, console)     # checks, connects, TorchTrainer.fit(), RUN_DIR/result.json
    ray_status(run_dir)                   # (state, one line) from RUN_DIR/submit/job.json and the run dir

What runs where: this process is Ray's driver (it starts a local Ray, or joins the cluster at
``address``); Ray Train's controller runs on the driver's node; each of the ``workers`` training
workers is a Ray actor that Ray places on a node with a free CPU (or GPU) and in which Ray has
already formed the torch process group (gloo, or nccl with GPUs) and exported torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR ...; ``ClusterEnv`` reads them, see
core/environment.py). ``ray_worker`` then runs tandem's own worker (tandem.train.worker.main):
checkpoints, metrics and rank logs go to the run dir, which every node must see.

Failures: a worker that raises, or dies with its node, makes Ray Train tear down the whole group
and start a new one, up to ``max_failures`` times (Ray's FailureConfig). The new group is a new
start of tandem's worker: with ``checkpoint.resume = "auto"`` it loads the run dir's newest
complete checkpoint, and the attempt counter (per-rank start files, agreed by the group as under
torchrun) names its logs ``.restartK`` and reports the steps redone.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import re
import runpy
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from tandem.core import rundir
from tandem.core.contract import AGENT_STARTS_ENV
from tandem.core.environment import ENV_BACKEND, ENV_DEVICE
from tandem.core.errors import ConfigError, LaunchError, WorkerFailure
from tandem.core.ray_address import check_ray_address
from tandem.core.spec import JobSpec

RAY_DIR = "ray"            # RUN_DIR/ray/: Ray Train's own storage (RunConfig.storage_path) and start files
# Sent to every worker (Ray starts them from its raylets, not from this shell): tandem's settings,
# the import path, and the knobs of the libraries underneath.
ENV_PREFIXES = ("TANDEM_", "GLOO_", "NCCL_", "TORCH_")
ENV_NAMES = ("PYTHONPATH",)


@dataclass
class RayJob:
    spec: JobSpec                   # validated, launch.run_dir already the absolute run dir
    run_dir: Path                   # absolute: the workers' working folder is Ray's, not ours
    workers: int = 1
    max_failures: int = 0
    address: str = ""               # "" : start a local Ray for this job (stopped at the end)
    use_gpu: bool | None = None     # None: when the spec's device is cuda, or auto and the cluster has GPUs


def check_installed() -> None:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        raise ConfigError("Ray Train is not installed", field="--on", value="ray",
                          fix="pip install 'tandem[ray]' (the ray extra; `make install` installs it)")


def check_resources(resources: dict, workers: int, use_gpu: bool) -> None:
    kind = "GPU" if use_gpu else "CPU"
    have = int(resources.get(kind, 0))
    if workers > have:
        raise LaunchError(f"{workers} workers need {workers} {kind}s, the cluster has {have}", field="--workers",
                          value=workers, fix=f"use --workers {have or 1} or fewer, or add nodes (`ray start "
                                             "--address HEAD:PORT` on another machine)")


def _worker_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def connect(address: str):
    """ray.init: the cluster at ``address``, else a new local one ("local": never another user's)."""
    import ray

    env = {"env_vars": _worker_env()}
    if address:
        check_ray_address(address)
        ray.init(address=address, runtime_env=env, logging_level="ERROR", log_to_driver=False)
    else:
        ray.init(address="local", runtime_env=env, logging_level="ERROR", log_to_driver=False,
                 include_dashboard=False)
    return ray


def _device(job: RayJob, resources: dict) -> tuple[bool, str, str]:
    want = job.spec.launch.device
    gpu = job.use_gpu if job.use_gpu is not None else \
        (want == "cuda" or (want == "auto" and resources.get("GPU", 0) > 0))
    backend = job.spec.launch.backend if job.spec.launch.backend not in ("", "auto") else ("nccl" if gpu else "gloo")
    return gpu, "cuda" if gpu else "cpu", backend


def ray_worker(config: dict) -> None:
    """Ray Train's training function: one tandem worker, with the rank and world Ray gave it."""
    import ray
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
    # The worker by module name, as the agents start it (`-m tandem.train.worker`): launch never imports
    # train. Not as __main__: that path leaves with os._exit, and Ray must see the function return.
    main = runpy.run_module("tandem.train.worker")["main"]
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


def write_record(run_dir: Path, /, **fields) -> dict:
    path = run_dir / "submit" / "job.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {**(json.loads(path.read_text()) if path.is_file() else {}), **fields}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    tmp.replace(path)
    return rec


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def fit(job: RayJob, attempt: int, on_poll=None) -> dict:
    """TorchTrainer.fit() on the connected cluster; RUN_DIR/result.json's content. Raises WorkerFailure
    when Ray gave up (max_failures spent), with Ray's reason in one line."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    gpu, device, backend = _device(job, ray.cluster_resources())
    run_id = uuid.uuid4().hex[:12]
    write_record(job.run_dir, engine="ray", state="RUNNING", submitted=_now(), address=job.address or "local",
                 workers=job.workers, max_failures=job.max_failures, device=device, backend=backend,
                 driver_pid=os.getpid(), driver_host=socket.gethostname(), run_id=run_id, attempt=attempt,
                 run_dir=str(job.run_dir), reason="")
    trainer = TorchTrainer(
        ray_worker,
        train_loop_config={"run_dir": str(job.run_dir), "run_id": run_id, "attempt": attempt, "device": device,
                           "backend": backend, "threads": job.spec.launch.threads_per_worker},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=job.workers, use_gpu=gpu),
        # Ray keeps no checkpoints of its own: tandem's are in the run dir (resume = auto finds them)
        run_config=RunConfig(name=f"tandem-{run_id}", storage_path=str(job.run_dir / RAY_DIR),
                             failure_config=FailureConfig(max_failures=job.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=None)))
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.5):
            on_poll()

    if on_poll is not None:
        threading.Thread(target=poll, daemon=True).start()
    try:
        trainer.fit()
    except Exception as e:  # ray.train.TrainingFailedError and its kin: the last worker error, as Ray saw it
        reason = _one_line(e)
        write_record(job.run_dir, state="FAILED", ended=_now(), reason=reason)
        raise WorkerFailure(f"Ray Train gave up after {job.max_failures} restart(s): {reason}",
                            fix=f"read {job.run_dir / rundir.LOGS}/rank-*.err.log; raise --max-failures to ride "
                                "out more failures") from None
    except BaseException:  # Ctrl-C: Ray Train's own handler aborts the workers; say so in the record
        write_record(job.run_dir, state="CANCELLED", ended=_now(), reason="the driver was interrupted")
        raise
    finally:
        done.set()
    try:
        result = json.loads((job.run_dir / rundir.RESULT).read_text())
    except (OSError, ValueError) as e:
        reason = f"Ray Train returned, but the workers wrote no readable {rundir.RESULT} ({e})"
        write_record(job.run_dir, state="FAILED", ended=_now(), reason=reason)
        raise WorkerFailure(reason, fix=f"read {job.run_dir / rundir.LOGS}/rank-*.err.log") from None
    write_record(job.run_dir, state="COMPLETED", ended=_now(), step=result.get("step"),
                 restarts=len(result.get("restarts") or []))
    return result


def _one_line(e: BaseException) -> str:
    """Ray's failure in one line: the first failed rank and its exception line (a Python error in tandem's
    worker ends Ray's text as "Type: message"; a worker that died names how, in its first sentence)."""
    fails = getattr(e, "worker_failures", None) or {}
    # the ranks that only lost a peer (gloo's "Connection closed by peer") come after the one that failed
    echo = ("closed by peer", "remote worker crash", "Connection reset")
    rank, err = min(fails.items(), key=lambda kv: (any(m in str(kv[1]) for m in echo), kv[0])) if fails else \
        (None, getattr(e, "controller_failure", e))
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    exc = next((ln for ln in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b[^:]*:", ln)),
               None)
    text = exc or f"{type(err).__name__}: {(lines[-1] if lines else '').split('. Some common causes')[0]}"
    return (f"rank {rank}: " if rank is not None else "") + text[:300]


def ray_status(run_dir: Path) -> tuple[str, str]:
    """(state, one line): the driver's record, checked against the driver still being alive, and the run
    dir's progress (last step, restarts)."""
    from tandem.launch.slurm import read_record

    rec = read_record(run_dir)
    state = rec.get("state", "?")
    if state == "RUNNING" and rec.get("driver_host") == socket.gethostname() and not _alive(rec.get("driver_pid")):
        state, rec["reason"] = "FAILED", f"the driver (pid {rec.get('driver_pid')}) is gone without a word"
    recs = rundir.read_metrics(run_dir)
    start = next((r for r in reversed(recs) if r.get("kind") == "start"), None)
    step = max((r["step"] for r in recs if r.get("kind") in ("step", "ckpt", "end") and "step" in r), default=None)
    restarts = sum(1 for r in recs if r.get("kind") == "restart")
    parts = [f"ray job {rec.get('run_id', '?')}: {state}", f"{rec.get('workers')} worker(s) on "
             f"{rec.get('address')} ({rec.get('device')}/{rec.get('backend')})"]
    if start is not None:
        parts.append(f"step {step if step is not None else start.get('start_step', 0)}/{start.get('total_steps')}")
    parts.append(f"restarted {restarts} time(s) (limit --max-failures {rec.get('max_failures')})")
    if state in ("FAILED", "CANCELLED"):
        parts.append(rec.get("reason") or "see the rank logs")
    return state, "; ".join(parts)


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        pass
    return True


def submit_ray(config: str, overrides: list[str], run_dir: Path, *, workers: int, max_failures: int,
               address: str, console) -> dict:
    """The driver of `tandem submit --on ray`: every check first (one line each, nothing written), then the
    run dir's lock, spec and attempt, then TorchTrainer.fit() with a progress bar; returns result.json."""
    from tandem.core.config import load_spec
    from tandem.core.runlock import RunLock

    check_installed()
    if workers < 1:
        raise ConfigError("must be at least 1", field="--workers", value=workers, fix="use 1 or more workers")
    if max_failures < 0:
        raise ConfigError("must not be negative", field="--max-failures", value=max_failures, fix="use 0 or more")
    run_dir = run_dir.resolve()  # the workers run in Ray's folders: every path they get is absolute
    spec = load_spec(config, [*overrides, "--launch.run_dir", str(run_dir), "--launch.nproc_per_node", str(workers),
                              "--launch.nnodes", "1", "--launch.simulate_nodes", "0"])
    ray = connect(address)
    try:
        job = RayJob(spec, run_dir, workers, max_failures, address)
        check_resources(ray.cluster_resources(), workers, _device(job, ray.cluster_resources())[0])
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir).acquire(lambda m: console.print(m, highlight=False, soft_wrap=True))
        try:
            from tandem.core.config import to_dict

            tmp = run_dir / f".{rundir.SPEC}.{os.getpid()}"
            tmp.write_text(json.dumps(to_dict(spec), indent=1))
            tmp.replace(run_dir / rundir.SPEC)
            attempt = rundir.start_attempt(run_dir)
            console.print(f"submitted: ray job, {workers} worker(s) on {address or 'a local Ray'}, up to "
                          f"{max_failures} restart(s); run dir {run_dir}", highlight=False, soft_wrap=True)
            console.print(f"  follow it: tandem status {run_dir}", highlight=False, soft_wrap=True)
            return _fit_with_progress(job, attempt, console)
        finally:
            lock.release()
    finally:
        ray.shutdown()  # a local Ray stops with it; a cluster's processes stay (they are the user's)


def _fit_with_progress(job: RayJob, attempt: int, console) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]ray"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=console) as progress:
        task = progress.add_task("ray", total=None, info="starting workers")

        def watch() -> None:
            recs = rundir.read_metrics(job.run_dir)
            start = next((r for r in reversed(recs) if r.get("kind") == "start"), None)
            if start is None:
                return
            last = next((r for r in reversed(recs) if r.get("kind") == "step"), None)
            restarts = sum(1 for r in recs if r.get("kind") == "restart")
            info = f"{start['world']} workers" + (f" | loss {last['loss']:.3f}" if last else "") + \
                   (f" | {restarts} restart(s)" if restarts else "")
            progress.update(task, total=start["total_steps"], completed=last["step"] if last else start["start_step"],
                            info=info)

        result = fit(job, attempt, on_poll=watch)
        watch()
    return result
