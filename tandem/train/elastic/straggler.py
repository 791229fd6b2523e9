"""Straggler report: per-rank data wait and busy time, compared across ranks every K steps.

In a data-parallel step every rank waits for the slowest in the collectives, so the
step time is the same everywhere. What differs per rank is the time outside them:

* *data wait*: time in ``next(loader)``, with no collective inside: a clean signal;
* *busy*: the step minus the last micro-batch (where the gradient all-reduce waits):
  data, the accumulation micro-steps, and, under DDP with buffers (BatchNorm), the
  forward's buffer broadcast, which makes every other rank wait for rank 0 (which also
  writes the metrics). Busy is recorded for inspection, not judged.

Every ``every`` steps the ranks all-gather their medians over the window and write a
``ranks`` record (``metrics.jsonl``). A rank whose data wait exceeds ``ratio`` times the
median of the others, and by at least ``min_ms``, in ``confirm`` (2) windows in a row is
named in the log and recorded (kind ``straggler``): one noisy window is not a straggler.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


class StragglerMonitor:
    def __init__(self, ctx, metrics, log, every: int, ratio: float, min_ms: float, confirm: int = 2) -> None:
        self.ctx, self.metrics, self.log = ctx, metrics, log
        self.every, self.ratio, self.min_ms, self.confirm = every, ratio, min_ms, confirm
        self.streak: dict[int, int] = {}
        self.busy: list[float] = []
        self.data: list[float] = []
        self.flagged: list[dict] = []

    def record(self, step: int, busy_s: float, data_s: float) -> list[dict]:
        """Collective every ``every`` steps (every rank calls it each step)."""
        if not self.every:
            return []
        self.busy.append(busy_s)
        self.data.append(data_s)
        if step % self.every:
            return []
        mine = torch.tensor([statistics.median(self.busy) * 1e3, statistics.median(self.data) * 1e3],
                            dtype=torch.float64)
        self.busy, self.data = [], []
        if dist.is_initialized() and self.ctx.world > 1:
            rows = [torch.zeros_like(mine) for _ in range(self.ctx.world)]
            dist.all_gather(rows, mine)
        else:
            rows = [mine]
        busy = [float(r[0]) for r in rows]
        data = [float(r[1]) for r in rows]
        self.metrics.write("ranks", step=step, busy_ms=busy, data_ms=data, window=self.every)
        found = []
        for r in range(len(rows)):
            if len(rows) < 2:
                break
            ref_b = statistics.median(busy[:r] + busy[r + 1:])
            ref_d = statistics.median(data[:r] + data[r + 1:])
            slow_d = data[r] > self.ratio * ref_d and data[r] - ref_d > self.min_ms
            self.streak[r] = self.streak.get(r, 0) + 1 if slow_d else 0
            if self.streak[r] < self.confirm:  # a straggler persists; one noisy window is not one
                continue
            what, mine_ms, ref = "data wait", data[r], ref_d
            rec = {"step": step, "rank": r, "what": what, "ms": round(mine_ms, 2), "ref_ms": round(ref, 2),
                   "ratio": round(mine_ms / max(ref, 1e-9), 2), "busy_ms": round(busy[r], 2),
                   "data_ms": round(data[r], 2), "data_ref_ms": round(ref_d, 2), "busy_ref_ms": round(ref_b, 2)}
            found.append(rec)
            self.metrics.write("straggler", **rec)
            self.log(f"straggler: rank {r} {what} {mine_ms:.1f} ms/step vs {ref:.1f} ms on the others "
                     f"({rec['ratio']:.1f}x; busy {busy[r]:.1f} vs {ref_b:.1f} ms, data wait {data[r]:.1f} vs "
                     f"{ref_d:.1f} ms) over steps {step - self.every * self.confirm + 1}-{step}", flush=True)
        self.flagged += found
        return found
