"""Per-run metrics: JSON lines on rank 0 (and TensorBoard scalars when it is installed).

``run_dir/metrics.jsonl`` holds one record per line, each with a ``kind``:

    start   world, nodes, global_batch, micro_batch, grad_accum, effective_lr, total_steps, ...
    step    step, epoch, loss, lr, samples_per_s, step_time_s, data_time_s; a mixture of experts adds
            moe_tokens_per_expert, moe_dropped_frac, moe_aux_loss and, under ep, ep_all_to_all_calls,
            ep_all_to_all_bytes, ep_all_to_all_bytes_per_call (tandem/train/parallel/expert.py)
    eval    epoch, step, accuracy, correct, total
    ckpt    step, path, save_s
    end     final step, accuracy, samples_per_s (training steps), wall_samples_per_s, wall time
    attempt attempt, pid, host, resume: written by `tandem train` at every start of the run dir

The file is only ever appended to: a rerun or a resume adds its records after an ``attempt``
record, so the loss curve and the stop record of every earlier start stay. ``read`` returns
the current attempt's records, ``read(..., all_attempts=True)`` the whole history.

``tandem train`` tails this file for its progress bar; later stages read it too.

Two throughputs, each named for what it measures (docs/train.md, "Throughput"):
``samples_per_s`` is training steps only (``training_rate``: the samples of the steps after the
first fifth over the time those steps took, their data waits included; no evaluation, checkpoints
or start-up), the number the bar, the done line, result.json and the demo table show;
``wall_samples_per_s`` is every sample trained over the training loop's wall time (evaluation,
checkpoints and the warm-up steps included).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tandem.core import rundir


def training_rate(rates: list[float], step_s: list[float]) -> float | None:
    """Samples/s in training steps: the samples of the steps after the first fifth (they pay for
    warm-up) over the time those steps took. A sum over a sum, not a mean of per-step rates, so a
    short last step (the epoch's remainder) weighs what it trained."""
    k = len(rates) // 5
    rates, step_s = rates[k:], step_s[k:]
    t = sum(step_s)
    return sum(r * s for r, s in zip(rates, step_s)) / t if t > 0 else None


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / rundir.METRICS
        self._f = open(self.path, "a") if enabled else None
        self._tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / rundir.TENSORBOARD))
            except Exception:  # tensorboard is optional
                self._tb = None

    def write(self, kind: str, **fields) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "time": time.time(), **fields}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in fields:
            for k, v in fields.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch", "time"):
                    self._tb.add_scalar(f"{kind}/{k}", v, fields["step"])

    def close(self) -> None:
        if self._f:
            self._f.close()
        if self._tb is not None:
            self._tb.close()


def read(run_dir: Path, all_attempts: bool = False) -> list[dict]:
    """The records of this attempt (or of every attempt): see ``rundir.read_metrics``."""
    return rundir.read_metrics(run_dir, all_attempts)
