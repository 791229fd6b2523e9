"""Synthetic Chrome traces in torch 2.13's shape (docs/diagnose.md): a main thread with ProfilerStep#N,
tandem.* ranges and cpu_op events, collectives on a gloo thread. Times in us, on the rank's own clock."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

MAIN, GLOO = 100, 101


class TraceBuilder:
    def __init__(self, rank: int, shift_us: float = 0.0) -> None:
        self.rank, self.shift, self.events = rank, shift_us, []
        self.pid = 1000 + rank

    def _x(self, name: str, a: float, b: float, cat: str, tid: int, args: dict | None = None) -> "TraceBuilder":
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": self.pid if tid == MAIN else self.pid,
                            "tid": self.pid if tid == MAIN else tid, "ts": a + self.shift, "dur": b - a,
                            "args": args or {}})
        return self

    def step(self, n: int, a: float, b: float):
        return self._x(f"ProfilerStep#{n}", a, b, "user_annotation", MAIN)

    def phase(self, name: str, a: float, b: float):
        return self._x(f"tandem.{name}", a, b, "user_annotation", MAIN)

    def op(self, a: float, b: float, name: str = "aten::mm"):
        return self._x(name, a, b, "cpu_op", MAIN)

    def c10d(self, a: float, b: float, numel: int = 1, name: str = "c10d::allreduce_"):
        return self._x(name, a, b, "cpu_op", MAIN, {"Input Dims": [[[numel]], [], []], "Input type": ["TensorList"]})

    def comm(self, a: float, b: float, numel: int = 1, name: str = "gloo:all_reduce"):
        return self._x(name, a, b, "cpu_op", GLOO, {"Input Dims": [[numel]], "Input type": ["float"]})

    def doc(self) -> dict:
        return {"traceEvents": list(self.events), "baseTimeNanoseconds": 1_700_000_000_000_000_000}

    def meta(self) -> dict:
        return {"rank": self.rank, "pid": self.pid}


def write_run(run: Path, builders, **meta) -> None:
    """RUN/profile/rank-K/trace.json.gz and window.json (with ``meta``) for each builder, as the profiler
    lays out a window."""
    for tb in builders:
        d = Path(run) / "profile" / f"rank-{tb.rank}"
        d.mkdir(parents=True)
        with gzip.open(d / "trace.json.gz", "wt") as fh:
            json.dump(tb.doc(), fh)
        (d / "window.json").write_text(json.dumps(dict(tb.meta(), **meta)))


def ddp_step(tb: TraceBuilder, n: int, t0: float, *, fwd: float = 3000, data: float = 200, buckets: int = 1,
             bucket_numel: int = 1000, comm_end: float | None = None) -> float:
    """One DDP-like step starting at t0: data, forward, backward issuing ``buckets`` all-reduces (the
    last one ends at ``comm_end``, an aligned moment every rank shares), optimizer. Returns its end."""
    t = t0 + 10
    tb.phase("data", t, t + data).op(t + 5, t + data - 5, "aten::stack")
    t += data + 10
    tb.phase("forward", t, t + fwd).op(t, t + fwd)
    t += fwd + 10
    bw_end_ops = t + 2000
    tb.op(t, bw_end_ops)
    for k in range(buckets):
        issue = t + 2000 * (k + 1) / buckets - 60
        tb.c10d(issue, issue + 20, bucket_numel)
        end = comm_end if (comm_end is not None and k == buckets - 1) else issue + 400
        tb.comm(issue + 20, max(end, issue + 40), bucket_numel)
    bw_end = max(bw_end_ops, comm_end or 0) + 5
    tb.phase("backward", t, bw_end)
    t = bw_end + 10
    tb.phase("optimizer", t, t + 500).op(t, t + 500)
    t += 520
    tb.step(n, t0, t)
    return t


def gpu_event(tb: TraceBuilder, name: str, a: float, b: float, stream: int, corr: int, cat: str = "kernel",
              device: int = 0) -> TraceBuilder:
    """An event on the GPU timeline as torch (Kineto) exports it: pid = the device, tid = the stream,
    args with device/stream/correlation, and its cudaLaunchKernel on the main thread (cat cuda_runtime)."""
    tb.events.append({"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream, "ts": a + tb.shift,
                      "dur": b - a, "args": {"queued": 0, "device": device, "context": 1, "stream": stream,
                                             "correlation": corr, "registers per thread": 32}})
    tb.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": tb.pid, "tid": tb.pid,
                      "ts": a + tb.shift - 20, "dur": 5, "args": {"cbid": 211, "correlation": corr}})
    return tb
