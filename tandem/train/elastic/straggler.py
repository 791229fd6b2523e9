"""Straggler report: per-rank busy time and data wait, compared across ranks every K steps.

In a data-parallel step every rank waits for the slowest in the gradient all-reduce,
so the step time is the same everywhere. What differs is the *busy* time: the step
minus the last backward (where the all-reduce waits), i.e. data loading, forwards and
the accumulation micro-steps. Every ``every`` steps the ranks all-gather the median
busy and data-wait times of the window; a rank whose busy time exceeds ``ratio`` times
the median of the others (and by at least ``min_ms``) is named in the log and in
``metrics.jsonl`` (kind ``straggler``). Each window also writes a ``ranks`` record with
every rank's numbers.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


class StragglerMonitor:
    def __init__(self, ctx, metrics, log, every: int, ratio: float, min_ms: float) -> None:
        self.ctx, self.metrics, self.log = ctx, metrics, log
        self.every, self.ratio, self.min_ms = every, ratio, min_ms
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
            others = busy[:r] + busy[r + 1:]
            if not others:
                continue
            ref = statistics.median(others)
            if busy[r] > self.ratio * ref and busy[r] - ref > self.min_ms:
                rec = {"step": step, "rank": r, "busy_ms": round(busy[r], 2), "ref_ms": round(ref, 2),
                       "ratio": round(busy[r] / max(ref, 1e-9), 2), "data_ms": round(data[r], 2),
                       "data_ref_ms": round(statistics.median(data[:r] + data[r + 1:]), 2)}
                found.append(rec)
                self.metrics.write("straggler", **rec)
                self.log(f"straggler: rank {r} busy {rec['busy_ms']:.1f} ms/step vs {ref:.1f} ms on the others "
                         f"({rec['ratio']:.1f}x; data wait {rec['data_ms']:.1f} vs {rec['data_ref_ms']:.1f} ms) "
                         f"over steps {step - self.every + 1}-{step}", flush=True)
        self.flagged += found
        return found
