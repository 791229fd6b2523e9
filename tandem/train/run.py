"""A training run from the parent's side: what `tandem train` and `tandem demo` run (cli/train.py, cli/demo.py).

The parent validates everything it can before a process starts (spec, device, the
checkpoint to resume and its model), writes RUN_DIR/spec.json, launches the workers,
shows a progress bar from RUN_DIR/metrics.jsonl, and prints the result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.core import contract, rundir
from tandem.core.config import to_dict
from tandem.core.errors import ConfigError, JobStopped, WorkerFailure
from tandem.core.runlock import RunLock
from tandem.core.spec import JobSpec
from tandem.launch import failures as fl
from tandem.launch.launcher import launch
from tandem.train import metrics
from tandem.train.checkpoint_meta import CheckpointMeta


def run_dir_of(spec: JobSpec) -> Path:
    return Path(spec.launch.run_dir.format(name=spec.name))


def preflight(spec: JobSpec, run_dir: Path) -> tuple[Path | None, CheckpointMeta | None]:
    """Checks that need torch but no process group: device, model, data, the checkpoint to resume
    and whether it is this spec's layout. Returns that checkpoint and its meta (None, None: fresh)."""
    from tandem.launch.launcher import quiet_cpp_logs
    from tandem.train.preflight import check_job  # torch inside: `tandem --help` and spec errors stay fast

    quiet_cpp_logs(False)  # before torch loads: an unreachable master is one line, not c10d's retry frames
    path, meta = check_job(spec, run_dir)
    if path is not None and spec.checkpoint.resume == "auto":
        check_same_layout(spec, meta, path)
    return path, meta


def check_same_layout(spec: JobSpec, meta: CheckpointMeta, path: Path) -> None:
    """`resume = auto` finds the run dir's own checkpoint: a spec that splits the model another way
    (another strategy, tp, pp, cp or ep) is most likely a new experiment pointed at an old run dir.
    Resharding is what DCP does well, but only when asked for (resume = that path)."""
    from tandem.train.elastic.resume import layout_of

    old, new = meta.parallel, layout_of(spec)
    if not old:  # checkpoints written before layouts were recorded
        return
    # cp and ep were recorded later: a checkpoint without them was written at 1
    diff = next((k for k in ("strategy", "tp", "pp", "cp", "ep") if old.get(k, 1) != new[k]), None)
    if diff is None:
        return

    def describe(d: dict) -> str:
        more = "".join(f", {k} {d[k]}" for k in ("cp", "ep") if d.get(k, 1) > 1)
        return f"{d['strategy']} (tp {d['tp']}, pp {d['pp']}{more})"

    raise ConfigError(f"the run dir's checkpoint {path.name} was trained as {describe(old)}, this spec asks for "
                      f"{describe(new)}; resuming would reshard it silently", field=f"parallel.{diff}",
                      value=new[diff], fix=f"give this run its own --launch.run_dir, start over with --fresh, "
                                           f"or reshard that checkpoint on purpose with --checkpoint.resume {path}")


def finished(spec: JobSpec, meta: CheckpointMeta | None) -> bool:
    """The checkpoint to resume is the last step of this same schedule: a rerun would train nothing."""
    from tandem.train.elastic.resume import schedule_key

    return (meta is not None and meta.total_steps is not None and meta.step >= meta.total_steps
            and meta.schedule_key == schedule_key(spec))


def archive(spec: JobSpec, run_dir: Path, console: Console) -> None:
    """--fresh: move the previous run (and a checkpoint.dir outside it) aside, never delete it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dirs = [run_dir] + ([Path(spec.checkpoint.dir)] if spec.checkpoint.dir else [])
    for d in dirs:  # a checkpoint.dir inside the run dir has moved with it
        if d.is_dir() and any(d.iterdir()):
            dest = d.with_name(f"{d.name}.{stamp}")
            d.rename(dest)
            console.print(f"--fresh: the previous run in {d} moved to {dest}", highlight=False)


def begin_attempt(run_dir: Path, resume: Path | None) -> int:
    """A new start of the run dir (a first start, a rerun after a stop, a resume): recorded in
    RUN_DIR/attempts.jsonl and marked in metrics.jsonl by an ``attempt`` record, after which the
    workers append theirs; nothing of an earlier start is moved, truncated or overwritten (the
    rank logs of attempt N > 1 are named ``rank-R.attemptN.log``). The previous result.json is
    the ``end`` record of its attempt, in metrics.jsonl: removed, so that it is never read as
    this attempt's."""
    return rundir.start_attempt(run_dir, resume)


class _Watch:
    """Progress bar fed by the rank-0 metrics file (workers write, the parent reads)."""

    def __init__(self, run_dir: Path, progress: Progress, label: str) -> None:
        self.run_dir, self.progress = run_dir, progress
        self.task = progress.add_task(label, total=None, info="starting workers")

    def __call__(self) -> None:
        recs = metrics.read(self.run_dir)
        start = next((r for r in reversed(recs) if r["kind"] == "start"), None)
        if start is None:
            return
        steps = [r for r in recs if r["kind"] == "step"]
        last = steps[-1] if steps else None
        acc = next((r for r in reversed(recs) if r["kind"] == "eval"), None)
        info = f"{start['world']} workers"
        if last:  # the done line's definition so far, not the last step's (a short remainder step reads low)
            rate = metrics.training_rate([r["samples_per_s"] for r in steps], [r["step_time_s"] for r in steps])
            info += f" | loss {last['loss']:.3f} | {rate or 0:.0f} samples/s in steps"
        if acc:
            info += f" | acc {acc['accuracy']:.3f}"
            if acc.get("bits_per_byte") is not None:  # data.name = tokens
                info += f" | {acc['bits_per_byte']:.3f} bits/byte"
        self.progress.update(self.task, total=start["total_steps"], completed=last["step"] if last else
                             start["start_step"], info=info)


class AlreadyComplete(Exception):
    """The run dir's newest checkpoint is this schedule's last step: nothing to train."""

    def __init__(self, run_dir: Path, path: Path, step: int) -> None:
        super().__init__(f"already complete at step {step}: nothing to do ({path})")
        self.run_dir, self.path, self.step = run_dir, path, step


def other_node(spec: JobSpec) -> bool:
    """A node other than node 0 of a static multi-node job (simulated nodes are one process tree)."""
    return spec.launch.node_rank != 0 and not spec.launch.simulate_nodes


def run_training(spec: JobSpec, console: Console, *, stream: bool = False, label: str = "train",
                 fresh: bool = False, run_files: dict[str, str] | None = None) -> dict:
    """Validate, launch, watch; returns RUN_DIR/result.json. Raises TandemError subclasses,
    and AlreadyComplete when a rerun would train nothing (RUN_DIR is left as it is). ``run_files``:
    {name: text} written into the run dir next to spec.json (from_plan.json)."""
    run_dir = run_dir_of(spec)
    joining = spec.elastic.join and (run_dir / rundir.SPEC).is_file()
    # a node joining a running job, or another node of a static multi-node job, shares its run dir on
    # purpose: no lock (node 0 holds it), no new attempt
    lock = RunLock(run_dir) if not (joining or other_node(spec)) else None
    say = lambda m: console.print(m, highlight=False, soft_wrap=True)  # noqa: E731
    if fresh:  # every check first (as a fresh start), so that a refused spec moves nothing
        path, meta = preflight(dataclasses.replace(spec, checkpoint=dataclasses.replace(spec.checkpoint,
                                                                                        resume="none")), run_dir)
        lock.acquire(say).release()  # a live job in the run dir: refused before anything moves
        archive(spec, run_dir, console)
    else:
        path, meta = preflight(spec, run_dir)
    if finished(spec, meta):
        raise AlreadyComplete(run_dir, path, meta.step)
    run_dir.mkdir(parents=True, exist_ok=True)
    if lock is not None:
        lock.acquire(say)
    try:
        for name, text in (run_files or {}).items():   # after the checks and --fresh's move, before the workers
            tmp = run_dir / f".{name}.{os.getpid()}"
            tmp.write_text(text)
            tmp.replace(run_dir / name)
        return _train_locked(spec, console, run_dir, path, joining, stream, label)
    finally:
        if lock is not None:
            lock.release()


def _train_locked(spec: JobSpec, console: Console, run_dir: Path, path: Path | None, joining: bool,
                  stream: bool, label: str) -> dict:
    if not joining:  # a node joining a running job (same run_dir) keeps the run's spec, metrics and result
        # every node writes the spec atomically (the same text); another node of a static multi-node job
        # (Slurm: one `tandem train` per node, often a shared run dir) leaves the attempt to node 0
        tmp = run_dir / f".{rundir.SPEC}.{os.getpid()}"
        tmp.write_text(json.dumps(to_dict(spec), indent=1))
        tmp.replace(run_dir / rundir.SPEC)
        attempt = begin_attempt(run_dir, path) if not other_node(spec) else rundir.NODE0_ATTEMPT
    else:
        os.environ[contract.JOINING_ENV] = "1"  # this process's agent: log names of their own (launch/logs.py)
        attempt = max(1, len(rundir.attempts(run_dir)))
    argv = ["-m", "tandem.train.worker", str(run_dir)]
    try:
        if stream:
            launch(spec.launch, argv, run_dir, attempt=attempt)
        else:
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console) as progress:
                watch = _Watch(run_dir, progress, label)
                if spec.launch.simulate_nodes:
                    launch(spec.launch, argv, run_dir, quiet=True, on_poll=watch, attempt=attempt)
                else:
                    done = threading.Event()

                    def poll() -> None:
                        while not done.wait(0.3):
                            watch()

                    t = threading.Thread(target=poll, daemon=True)
                    t.start()
                    try:
                        launch(spec.launch, argv, run_dir, quiet=True, attempt=attempt)
                    finally:
                        done.set()
                        t.join()
                    watch()
    except WorkerFailure:
        fl.render(fl.read_failures(run_dir), console)
        raise
    except JobStopped as e:  # say what a rerun would really do
        e.fix = rerun_hint(spec, run_dir)
        raise
    result = run_dir / rundir.RESULT
    if (spec.elastic.join or other_node(spec)) and not result.is_file():  # rank 0 runs on another node
        console.print(f"done: this node's workers finished; the result is in rank 0's run_dir ({result} "
                      "on the node that ran rank 0)", highlight=False)
        raise SystemExit(0)
    return json.loads(result.read_text())


def rerun_hint(spec: JobSpec, run_dir: Path) -> str:
    from tandem.train import checkpoint as ckpt
    from tandem.train.elastic.resume import checkpoint_dir

    newest = ckpt.latest(checkpoint_dir(spec, run_dir))
    if spec.checkpoint.resume == "none" or newest is None:
        return "no checkpoint was saved: run the same command again to start over"
    return f"run the same command again: it resumes from {newest}"


def print_result(result: dict, run_dir: Path, console: Console) -> None:
    acc = (f"{result['accuracy']:.4f}" if result.get("accuracy") is not None else
           "not measured (it runs at the end of each epoch; this run ended before one)")
    rate = (f"{result['samples_per_s']:.0f} samples/s in training steps" if result.get("samples_per_s") is not None
            else "no steps trained")
    if result.get("wall_samples_per_s") is not None:  # result.json of this release: the wall rate beside it
        rate += f" ({result['wall_samples_per_s']:.0f}/s wall, incl. eval and checkpoints)"
    console.print(f"[green]done[/]: {result['step']} steps on {result['world']} workers, "
                  f"{rate}, held-out accuracy {acc}", highlight=False)
    if result.get("bits_per_byte") is not None:  # data.name = tokens: the model against order-0 statistics
        console.print(f"  held-out loss {result['held_out_loss']:.4f}, {result['bits_per_byte']:.3f} bits per byte "
                      f"(order-0 byte entropy of the same text: {result['order0_bits_per_byte']:.3f})",
                      highlight=False)
    for r in result.get("restarts") or []:
        console.print(f"  restart {r.get('restart')}: resumed at step {r.get('resumed_step')}, "
                      f"{r.get('steps_redone')} step(s) redone, {r.get('lost_s', 0):.1f} s lost", highlight=False)
    console.print(f"  checkpoint: {result['checkpoint']}\n  logs: {run_dir / rundir.LOGS}/rank-*.log"
                  f"\n  metrics: {run_dir / rundir.METRICS}", highlight=False)
