"""`tandem submit --on ray`: this process is Ray's driver, and tandem's worker is Ray Train's training function.

    result = submit_ray(RayOptions(spec_path, overrides, run_dir, workers=2, max_failures=3), console)
                                          # checks, connects, TorchTrainer.fit(), RUN_DIR/result.json's content
    ray_status(run_dir)                   # (state, one line) from RUN_DIR/submit/job.json and the run dir
    RayBackend                            # the same, as backend.py's interface

What runs where: this process is Ray's driver (it starts a local Ray, or joins the cluster at
``address``); Ray Train's controller runs on the driver's node; each of the ``workers`` training
workers is a Ray actor that Ray places on a node with a free CPU (or GPU) and in which Ray has
already formed the torch process group (gloo, or nccl with GPUs) and exported torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR ...; ``ClusterEnv`` reads them, see
core/environment.py). ``ray_worker`` (ray_worker.py) then runs the worker named by ``RayJob.entry``,
tandem's own (``tandem.train.worker:main``) unless told otherwise: checkpoints, metrics and rank
logs go to the run dir, which every node must see.

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
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from tandem.core import rundir
from tandem.core.config import load_spec, to_dict
from tandem.core.errors import ConfigError, LaunchError, WorkerFailure
from tandem.core.ray_address import check_ray_address
from tandem.core.runlock import RunLock
from tandem.core.spec import JobSpec
from tandem.submit.backend import SPEC_SUFFIXES, Status, SubmitFlags, Submitted
from tandem.submit.record import read_record, update_record
from tandem.submit.ray_worker import RAY_DIR, WORKER_ENTRY, ray_worker
# Sent to every worker (Ray starts them from its raylets, not from this shell): tandem's settings,
# the import path, and the knobs of the libraries underneath.
ENV_PREFIXES = ("TANDEM_", "GLOO_", "NCCL_", "TORCH_")
ENV_NAMES = ("PYTHONPATH",)


@dataclass(kw_only=True)
class RayJob:
    spec: JobSpec                   # validated, launch.run_dir already the absolute run dir
    run_dir: Path                   # absolute: the workers' working folder is Ray's, not ours
    workers: int = 1
    max_failures: int = 0
    address: str = ""               # "" : start a local Ray for this job (stopped at the end)
    use_gpu: bool | None = None     # None: when the spec's device is cuda, or auto and the cluster has GPUs
    entry: str = WORKER_ENTRY       # MODULE:FUNCTION each Ray worker imports and runs (ray_worker.py)


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
    update_record(job.run_dir, engine="ray", state="RUNNING", submitted=_now(), address=job.address or "local",
                 workers=job.workers, max_failures=job.max_failures, device=device, backend=backend,
                 driver_pid=os.getpid(), driver_host=socket.gethostname(), run_id=run_id, attempt=attempt,
                 run_dir=str(job.run_dir), reason="")
    trainer = TorchTrainer(
        ray_worker,
        train_loop_config={"run_dir": str(job.run_dir), "run_id": run_id, "attempt": attempt, "device": device,
                           "backend": backend, "threads": job.spec.launch.threads_per_worker,
                           "entry": job.entry},
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
        update_record(job.run_dir, state="FAILED", ended=_now(), reason=reason)
        raise WorkerFailure(f"Ray Train gave up after {job.max_failures} restart(s): {reason}",
                            fix=f"read {job.run_dir / rundir.LOGS}/rank-*.err.log; raise --max-failures to ride "
                                "out more failures") from None
    except BaseException:  # Ctrl-C: Ray Train's own handler aborts the workers; say so in the record
        update_record(job.run_dir, state="CANCELLED", ended=_now(), reason="the driver was interrupted")
        raise
    finally:
        done.set()
    try:
        result = json.loads((job.run_dir / rundir.RESULT).read_text())
    except (OSError, ValueError) as e:
        reason = f"Ray Train returned, but the workers wrote no readable {rundir.RESULT} ({e})"
        update_record(job.run_dir, state="FAILED", ended=_now(), reason=reason)
        raise WorkerFailure(reason, fix=f"read {job.run_dir / rundir.LOGS}/rank-*.err.log") from None
    update_record(job.run_dir, state="COMPLETED", ended=_now(), step=result.get("step"),
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


@dataclass(frozen=True)
class RayOptions:
    """`--on ray`'s flags; the spec is loaded, and the cluster asked, only once the checks pass."""
    target: str                     # a job spec (.toml/.yaml)
    overrides: tuple[str, ...] = ()
    run_dir: Path = Path("runs/submit")
    workers: int = 1
    max_failures: int = 0
    address: str = ""


def load_job(options: RayOptions) -> RayJob:
    """Every check that needs no cluster (one line each, nothing written), then the spec as the workers get it."""
    if options.workers < 1:
        raise ConfigError("must be at least 1", field="--workers", value=options.workers, fix="use 1 or more workers")
    if options.max_failures < 0:
        raise ConfigError("must not be negative", field="--max-failures", value=options.max_failures,
                          fix="use 0 or more")
    run_dir = options.run_dir.resolve()  # the workers run in Ray's folders: every path they get is absolute
    spec = load_spec(options.target, [*options.overrides, "--launch.run_dir", str(run_dir), "--launch.nproc_per_node",
                                      str(options.workers), "--launch.nnodes", "1", "--launch.simulate_nodes", "0"])
    return RayJob(spec=spec, run_dir=run_dir, workers=options.workers, max_failures=options.max_failures,
                  address=options.address)


def check_target(target: str) -> None:
    if not target.endswith(SPEC_SUFFIXES):
        raise ConfigError("Ray runs a job spec (the trainer is Ray Train's training function)", field="--on",
                          value=target, fix="give a .toml/.yaml job spec, or use --on slurm|k8s for a script")


def submit_ray(options: RayOptions, console: Console) -> dict:
    """The driver of `tandem submit --on ray`: every check first (one line each, nothing written), then the
    run dir's lock, spec and attempt, then TorchTrainer.fit() with a progress bar; returns result.json."""
    check_target(options.target)
    check_installed()
    job = load_job(options)
    run_dir, workers, address = job.run_dir, job.workers, job.address
    ray = connect(address)
    try:
        check_resources(ray.cluster_resources(), workers, _device(job, ray.cluster_resources())[0])
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir).acquire(lambda m: console.print(m, highlight=False, soft_wrap=True))
        try:
            tmp = run_dir / f".{rundir.SPEC}.{os.getpid()}"
            tmp.write_text(json.dumps(to_dict(job.spec), indent=1))
            tmp.replace(run_dir / rundir.SPEC)
            attempt = rundir.start_attempt(run_dir)
            console.print(f"submitted: ray job, {workers} worker(s) on {address or 'a local Ray'}, up to "
                          f"{job.max_failures} restart(s); run dir {run_dir}", highlight=False, soft_wrap=True)
            console.print(f"  follow it: tandem status {run_dir}", highlight=False, soft_wrap=True)
            return _fit_with_progress(job, attempt, console)
        finally:
            lock.release()
    finally:
        ray.shutdown()  # a local Ray stops with it; a cluster's processes stay (they are the user's)


def render(job: RayJob) -> str:
    """The dry run's text: what the driver would start, and the spec every worker would read."""
    return (f"# ray job: TorchTrainer with {job.workers} worker(s) on {job.address or 'a local Ray'}, up to "
            f"{job.max_failures} restart(s) (FailureConfig), device {job.spec.launch.device}\n"
            f"# each worker runs {job.entry}({str(job.run_dir)!r}) once Ray has formed its process group; "
            f"{job.run_dir / rundir.SPEC}:\n{json.dumps(to_dict(job.spec), indent=1)}\n")


def done_line(result: dict, run_dir: Path) -> str:
    restarts = result.get("restarts") or []
    redone = sum(x.get("steps_redone", 0) for x in restarts)
    last = next((m for m in reversed(rundir.read_metrics(run_dir)) if m.get("kind") == "step"), {})
    acc = f"{result['accuracy']:.4f}" if result.get("accuracy") is not None else "not measured"
    return (f"[green]done[/]: {result['step']} steps on {result['world']} Ray workers, last loss "
            f"{last.get('loss', 0):.4f}, "
            f"held-out accuracy {acc}, {len(restarts)} restart(s) ({redone} step(s) redone)\n"
            f"  checkpoint: {result.get('checkpoint')}\n  logs: {run_dir.resolve() / 'logs'}/rank-*.log")


class RayBackend:
    """`--on ray`: Ray Train's workers run tandem's worker; this process drives them, in the foreground."""

    name = "ray"

    def options(self, flags: SubmitFlags) -> RayOptions:
        return RayOptions(target=flags.target, overrides=flags.args, run_dir=flags.run_dir,
                          workers=flags.workers or flags.nodes * flags.nproc_per_node,
                          max_failures=flags.max_failures, address=flags.address)

    def dry_run(self, options: RayOptions) -> str:
        check_target(options.target)
        return render(load_job(options))

    def submit(self, options: RayOptions, console: Console) -> Submitted:
        return Submitted((done_line(submit_ray(options, console), options.run_dir),))

    def status(self, run_dir: Path) -> Status:
        state, line = ray_status(run_dir)
        return Status(state, line, ended_badly=state in ("FAILED", "CANCELLED"))

    def cancel(self, run_dir: Path) -> str:
        raise ConfigError("cancel of ray jobs is not implemented", field="run_dir", value=str(run_dir),
                          fix="Ctrl-C the `tandem submit` driver (Ray stops the workers)")

    def logs(self, run_dir: Path) -> str | None:
        return None  # the workers' output is redirected into the run dir's rank logs (ray_worker.py)


def _fit_with_progress(job: RayJob, attempt: int, console: Console) -> dict:
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
