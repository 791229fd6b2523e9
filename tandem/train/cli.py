"""`tandem train CONFIG [--section.key VALUE ...]` and `tandem demo`.

The parent validates everything it can before a process starts (spec, device, the
checkpoint to resume and its model), writes RUN_DIR/spec.json, launches the workers,
shows a progress bar from RUN_DIR/metrics.jsonl, and prints the result.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.core.config import load_spec, to_dict
from tandem.core.console import make_console
from tandem.core.errors import WorkerFailure
from tandem.core.spec import JobSpec
from tandem.launch import failures as fl
from tandem.launch.launcher import launch
from tandem.train import metrics


def split_flags(args: list[str], names: tuple[str, ...]) -> tuple[list[str], set[str]]:
    """Our own flags may come after CONFIG, among the overrides: take them out."""
    return [a for a in args if a not in names], {a for a in args if a in names}


def run_dir_of(spec: JobSpec) -> Path:
    return Path(spec.launch.run_dir.format(name=spec.name))


def preflight(spec: JobSpec, run_dir: Path) -> None:
    """Checks that need torch but no process group: device, model, data, the checkpoint to resume."""
    from tandem.launch.launcher import quiet_cpp_logs
    from tandem.train.preflight import check_job  # torch inside: `tandem --help` and spec errors stay fast

    quiet_cpp_logs(False)  # before torch loads: an unreachable master is one line, not c10d's retry frames
    check_job(spec, run_dir)


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
        last = next((r for r in reversed(recs) if r["kind"] == "step"), None)
        acc = next((r for r in reversed(recs) if r["kind"] == "eval"), None)
        info = f"{start['world']} workers"
        if last:
            info += f" | loss {last['loss']:.3f} | {last['samples_per_s']:.0f} samples/s"
        if acc:
            info += f" | acc {acc['accuracy']:.3f}"
        self.progress.update(self.task, total=start["total_steps"], completed=last["step"] if last else
                             start["start_step"], info=info)


def run_training(spec: JobSpec, console: Console, *, stream: bool = False, label: str = "train") -> dict:
    """Validate, launch, watch; returns RUN_DIR/result.json. Raises TandemError subclasses."""
    run_dir = run_dir_of(spec)
    preflight(spec, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    joining = spec.elastic.join and (run_dir / "spec.json").is_file()
    if not joining:  # a node joining a running job (same run_dir) keeps the run's spec, metrics and result
        (run_dir / "spec.json").write_text(json.dumps(to_dict(spec), indent=1))
        (run_dir / "result.json").unlink(missing_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    if joining:
        from tandem.launch.logs import JOINING_ENV

        os.environ[JOINING_ENV] = "1"  # this process's agent: log names of their own (launch/logs.py)
    argv = ["-m", "tandem.train.worker", str(run_dir)]
    try:
        if stream:
            launch(spec.launch, argv, run_dir)
        else:
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console) as progress:
                watch = _Watch(run_dir, progress, label)
                if spec.launch.simulate_nodes:
                    launch(spec.launch, argv, run_dir, quiet=True, on_poll=watch)
                else:
                    done = threading.Event()

                    def poll() -> None:
                        while not done.wait(0.3):
                            watch()

                    t = threading.Thread(target=poll, daemon=True)
                    t.start()
                    try:
                        launch(spec.launch, argv, run_dir, quiet=True)
                    finally:
                        done.set()
                        t.join()
                    watch()
    except WorkerFailure:
        fl.render(fl.read_failures(run_dir), console)
        raise
    result = run_dir / "result.json"
    if spec.elastic.join and not result.is_file():  # rank 0 ran on a node whose run_dir is not shared
        console.print(f"done: this node's workers finished; the result is in rank 0's run_dir ({result} "
                      "on the node that ran rank 0)", highlight=False)
        raise SystemExit(0)
    return json.loads(result.read_text())


def print_result(result: dict, run_dir: Path, console: Console) -> None:
    acc = f"{result['accuracy']:.4f}" if result.get("accuracy") is not None else "n/a (no held-out set)"
    console.print(f"[green]done[/]: {result['step']} steps on {result['world']} workers, "
                  f"{result['samples_per_s']:.0f} samples/s, held-out accuracy {acc}", highlight=False)
    for r in result.get("restarts") or []:
        console.print(f"  restart {r.get('restart')}: resumed at step {r.get('resumed_step')}, "
                      f"{r.get('steps_redone')} step(s) redone, {r.get('lost_s', 0):.1f} s lost", highlight=False)
    console.print(f"  checkpoint: {result['checkpoint']}\n  logs: {run_dir / 'logs'}/rank-*.log"
                  f"\n  metrics: {run_dir / 'metrics.jsonl'}", highlight=False)


def train_cmd(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="Job spec (.toml or .yaml); see `tandem spec` for every field."),
    stream: bool = typer.Option(False, "--stream", help="Stream every rank's output (rank-prefixed) "
                                                        "instead of a progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Train the job in CONFIG; override any field with --section.key VALUE.

    Example: tandem train examples/digits_resnet.toml --launch.simulate_nodes 2 --launch.nproc_per_node 2
    """
    overrides, flags = split_flags(ctx.args, ("--json", "--stream"))
    as_json, stream = as_json or "--json" in flags, stream or "--stream" in flags
    spec = load_spec(config, overrides)
    console = make_console(stderr=as_json)
    result = run_training(spec, console, stream=stream)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        print_result(result, run_dir_of(spec), console)


def demo_cmd(
    config: str = typer.Option("examples/digits_resnet.toml", "--config", help="Job spec of the demo."),
    run_dir: str = typer.Option("runs/demo", "--run-dir", help="Where both runs go."),
) -> None:
    """The seed's case at CPU scale: 2 simulated nodes x 2 workers, DDP, bf16, cosine LR, digits.

    Measures throughput on 1 worker, then trains on 4 and prints the table.
    """
    from tandem.train.demo import run_demo

    run_demo(config, Path(run_dir), make_console())
