"""`tandem bench train`: measured scaling of a training job next to what `tandem plan` predicts.

Weak scaling, as data-parallel jobs grow: every worker keeps its micro-batch, the
global batch is workers x micro-batch (one micro-batch per step, no accumulation).
For each worker count the built-in trainer runs a fixed number of steps through the
launcher; the step time is the median over the steps after the first fifth (the
trainer's own warm-up cut). The planner gets the same job spec with this machine's
calibration and predicts the step time for the same worker count.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import threading
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from tandem.core.config import load_spec, to_dict
from tandem.core.errors import ConfigError
from tandem.core.spec import JobSpec


@dataclass
class TrainBenchOptions:
    workers: list[int] = field(default_factory=lambda: [1, 2])
    steps: int = 30
    micro_batch: int = 0         # 0: the spec's
    config: str = ""             # job spec; "" = the built-in workload
    precision: str = ""          # "" = the spec's

    def validate(self) -> "TrainBenchOptions":
        if not self.workers or any(w < 1 for w in self.workers):
            raise ConfigError("worker counts must be positive", field="--workers", value=self.workers,
                              fix="e.g. --workers 1,2,4")
        if self.steps < 5:
            raise ConfigError("too few steps to time (the first fifth is warm-up)", field="--steps",
                              value=self.steps, fix="use --steps 10 or more")
        return self


def builtin_spec() -> JobSpec:
    """A small ResNet-18 on the bundled digits: seconds per run on a laptop CPU, fp32 (CPU bf16 is emulated)."""
    return load_spec(None, {"name": "bench-train", "model.width": "16", "model.in_channels": "1",
                            "model.num_classes": "10", "model.small_input": "true", "data.name": "digits",
                            "data.image_size": "8", "data.held_out": "0", "schedule.micro_batch": "32",
                            "schedule.global_batch": "32", "precision.dtype": "fp32", "optim.ref_batch": "0",
                            "schedule.log_every": "1000"})


def spec_for(base: JobSpec, opts: TrainBenchOptions, workers: int, run_dir: Path) -> JobSpec:
    micro = opts.micro_batch or base.schedule.micro_batch
    # Every row gets the same intra-op threads per worker (those of the largest row), so a
    # row differs from the next only in worker count; the launcher's default (cores / workers)
    # would give the 1-worker row all cores and measure thread scaling instead.
    threads = base.launch.threads_per_worker or max(1, (os.cpu_count() or 1) // max(opts.workers))
    return dataclasses.replace(
        base, name=f"bench-train-{workers}",
        data=dataclasses.replace(base.data, held_out=0.0),  # no evaluation inside the timed run
        schedule=dataclasses.replace(base.schedule, micro_batch=micro, global_batch=micro * workers,
                                     max_steps=opts.steps, epochs=max(base.schedule.epochs, 1000),
                                     warmup_steps=0, log_every=10 ** 6),
        precision=dataclasses.replace(base.precision, dtype=opts.precision or base.precision.dtype),
        checkpoint=dataclasses.replace(base.checkpoint, resume="none", every_steps=0, at_end=False),
        launch=dataclasses.replace(base.launch, nproc_per_node=workers, simulate_nodes=0, nnodes="1",
                                   threads_per_worker=threads, run_dir=str(run_dir / f"w{workers}")))


def steady_steps(run_dir: Path) -> list[float]:
    """Step times after the first fifth (the trainer's warm-up: allocator, oneDNN kernel choice)."""
    from tandem.train import metrics

    times = [r["step_time_s"] for r in metrics.read(run_dir) if r["kind"] == "step"]
    return times[len(times) // 5:] or times


def measured_step_s(run_dir: Path) -> float:
    return statistics.median(steady_steps(run_dir))


def predict(spec_path: Path, calibration: Path, workers: int) -> dict:
    """The planner's step time for this job on `workers` workers of this machine."""
    from tandem.plan.cost import evaluate
    from tandem.plan.inputs.args import PlanArgs, resolve, strategy

    m, c, t, v = resolve(PlanArgs(config=str(spec_path), calibration=str(calibration), gpus_per_node=workers,
                                  nodes=1))
    p = evaluate(m, c, t, strategy(v, c, t))
    return {"step_s": p.step_s, "compute_s": p.compute_s, "comm_s": p.exposed_comm_s,
            "model_flops_per_worker": p.model_flops_per_gpu, "hw_flops_per_worker": p.hw_flops_per_gpu,
            "flops_per_sample": m.flops_per_sample,
            "host_factors": p.host_factors}


class RunnableSampler:
    """Mean of /proc/stat procs_running while a run goes on: how busy the host is besides us."""

    def __init__(self, period_s: float = 0.1):
        self.period_s, self.samples = period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                for line in Path("/proc/stat").read_text().splitlines():
                    if line.startswith("procs_running"):
                        self.samples.append(int(line.split()[1]))
            except OSError:  # not Linux: no sample, background counts as 0
                return

    def __enter__(self) -> "RunnableSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def background(self, own_threads: int) -> float:
        """Runnable threads that are not the worker's (own_threads) nor this sampler's (1)."""
        return max(0.0, statistics.mean(self.samples) - own_threads - 1) if self.samples else 0.0


def model_entry(spec: JobSpec, wdir: Path, pred: dict, background: float) -> dict:
    """calibration compute.model from a 1-worker run: the model's FLOP/s on its whole step, the host."""
    steady = steady_steps(wdir)
    step = statistics.median(steady)
    return {"name": spec.model.name, "width": spec.model.width, "precision": spec.precision.dtype,
            "micro_batch": spec.schedule.micro_batch, "flops_per_sample": pred["flops_per_sample"],
            # Executed FLOPs (activation recompute included): the planner divides executed FLOPs by it.
            "step_s": step, "achieved_flops": pred["hw_flops_per_worker"] / step,
            "threads_per_worker": spec.launch.threads_per_worker, "cores": os.cpu_count() or 1,
            "background_threads": background, "step_samples_s": sorted(steady)}


def run(opts: TrainBenchOptions, run_dir: Path, calibration: Path, console: Console) -> dict:
    """Measure every worker count; the 1-worker run (first) calibrates the model, the others are predicted."""
    from tandem.train.run import run_training

    base = load_spec(opts.config) if opts.config else builtin_spec()
    rows, model = [], {}
    for n in sorted(opts.workers, key=lambda w: (w != 1, w)):
        spec = spec_for(base, opts, n, run_dir)
        wdir = Path(spec.launch.run_dir)
        wdir.mkdir(parents=True, exist_ok=True)
        spec_path = wdir / "bench-spec.yaml"
        spec_path.write_text(yaml.safe_dump(to_dict(spec)))
        with RunnableSampler() as load:
            result = run_training(spec, console, label=f"{n} worker(s)")
        step = measured_step_s(wdir)
        if n == 1:  # calibrate on this row, before any prediction
            model = model_entry(spec, wdir, predict(spec_path, calibration, n),
                                load.background(spec.launch.threads_per_worker))
            write_model_flops(calibration, model)
        pred = predict(spec_path, calibration, n)
        rows.append({"workers": n, "global_batch": spec.schedule.global_batch, "step_s": step,
                     "samples_per_s": spec.schedule.global_batch / step,
                     "trainer_samples_per_s": result.get("samples_per_s"), "calibration_row": n == 1,
                     "predicted_step_s": pred["step_s"], "predicted_compute_s": pred["compute_s"],
                     "predicted_comm_s": pred["comm_s"], "ratio": pred["step_s"] / step,
                     "host_factors": pred["host_factors"], "model_flops_per_worker": pred["model_flops_per_worker"],
                     # diagnostic only (the prediction uses the calibration run's): the host's load now
                     "background_threads": load.background(n * spec.launch.threads_per_worker)})
    return summarize(rows, model, calibration)


def summarize(rows: list[dict], model: dict, calibration: Path) -> dict:
    """Speedup, efficiency and the planner's median error over the rows it predicted (not the calibration row)."""
    base_rate = rows[0]["samples_per_s"] / rows[0]["workers"]
    for r in rows:
        r["speedup"] = r["samples_per_s"] / base_rate  # against the first row, per worker
        r["efficiency"] = r["speedup"] / r["workers"]
    predicted = [r for r in rows if not r.get("calibration_row")]
    errs = [abs(r["ratio"] - 1) for r in predicted or rows]
    return {"schema": "tandem.bench.train/1", "rows": rows, "model": model,
            "median_abs_pred_error": statistics.median(errs), "error_rows": "predicted" if predicted else "all",
            "calibration": str(calibration)}


def write_model_flops(calibration: Path, model: dict) -> None:
    """Write compute.model; the matmul numbers (compute.achieved_flops) stay as `bench comm` measured them."""
    if not model:
        return
    doc = json.loads(calibration.read_text())
    doc.setdefault("compute", {})["model"] = model
    tmp = calibration.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(calibration)


def table(res: dict) -> Table:
    t = Table(title="training scaling (weak: micro-batch per worker fixed) vs `tandem plan` on this calibration",
              title_justify="left", header_style="bold")
    for col in ("workers", "global batch", "step (ms)", "samples/s", "speedup", "efficiency",
                "predicted step (ms)", "predicted/measured"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(str(r["workers"]), str(r["global_batch"]), f"{r['step_s'] * 1e3:.1f}",
                  f"{r['samples_per_s']:.0f}", f"{r['speedup']:.2f}x", f"{r['efficiency'] * 100:.0f}%",
                  f"{r['predicted_step_s'] * 1e3:.1f}",
                  f"{r['ratio']:.2f}" + (" (calibration row)" if r.get("calibration_row") else ""))
    return t
