"""The trainer's profiling window and phase markers (the `[profile]` section of the job spec).

    prof = StepProfiler(spec.profile, ctx, run_dir)
    prof.step(done)                      # top of every optimizer step (done = steps finished)
    with prof.phase("forward"): ...      # tandem.data | forward | backward | optimizer | sync | checkpoint
    prof.close()                         # after the loop: a window cut short is still written

Inside the window the phases are ``record_function`` ranges named ``tandem.<phase>``; on CUDA
they are also NVTX ranges (for the whole run, so Nsight Systems shows the same names).
Outside the window, and on CPU, ``phase`` returns one shared no-op context: a flag test.

What a window writes, per rank (read by ``tandem diagnose``, docs/diagnose.md):

    RUN_DIR/profile/rank-R/trace.json.gz   torch's Chrome trace; ProfilerStep#N is metrics.jsonl's step N
    RUN_DIR/profile/rank-R/window.json     rank, world, steps, clock: the window's barrier exits (Unix ns),
                                           the main thread's CPU and run-queue time over the window,
                                           MemTracker's peak by category, the step after the window
    RUN_DIR/profile/rank-R/flight_recorder.json   torch's flight recorder entries of the window
    RUN_DIR/profile/rank-R/memory_snapshot.pickle|json   on CUDA, the step after the window under the
                                           allocator's history instead of MemTracker (tandem/train/cuda_memory.py)

At the window's start every rank passes ``clock_rounds`` barriers, each inside a ``tandem.clock``
range: all ranks leave a barrier at (almost) the same moment, so the ends of those ranges give
each rank's clock offset; diagnose refines it with the ends of the matched collectives.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.core import rundir

PREFIX = "tandem."
_NULL = contextlib.nullcontext()


class StepProfiler:
    def __init__(self, spec, ctx, run_dir: Path) -> None:
        self.spec, self.ctx = spec, ctx
        self.dir = Path(run_dir) / rundir.PROFILE / f"rank-{ctx.rank}"
        self.on = bool(spec is not None and spec.enabled)
        self.nvtx = bool(spec is not None and spec.nvtx and ctx.device.type == "cuda")
        self.recording = False
        self._prof = None
        self._clock: list[int] = []
        self._steps: list[int] = []
        self._cmem = None   # the CUDA memory step (tandem/train/cuda_memory.py), on GPUs
        if self.on:
            self.first, self.last = spec.start_step, spec.start_step + spec.steps - 1

    def track(self, model, optim) -> None:
        """The module and optimizer MemTracker attributes memory to (profile.memory)."""
        self._tracked = (model, optim)

    def phase(self, name: str):
        mt = getattr(self, "_mt", None)
        if mt is not None and name in ("forward", "forward_backward"):
            # gradient accumulation: MemTracker refuses a module's second forward in one tracking; its
            # per-module stats restart per micro-batch, the device-wide peak (what is reported) runs on
            if self._mt_forwards:
                mt.reset_mod_stats()
            self._mt_forwards += 1
        if self.recording:
            return _Phase(PREFIX + name, self.nvtx)
        if self._cmem is not None:  # the CUDA memory step: where each allocation was made
            return self._cmem.phase(PREFIX + name, self.nvtx)
        if self.nvtx:
            return torch.cuda.nvtx.range(PREFIX + name)
        return _NULL

    def step(self, done: int) -> None:
        """Called at the top of each step; ``done + 1`` is the step about to run."""
        if getattr(self, "_mt", None) is not None or self._cmem is not None:
            self._memory_exit()
        if not self.on:
            return
        n = done + 1
        if self._prof is None:
            if n > self.last or n < self.first - 1:
                return
            self._start(n)
        else:
            if n > self.last:  # before the export, which takes a while
                self._sched1 = _schedstat()
            self._prof.step()
        if n > self.last:
            self._finish()
            self._memory_enter(n)  # the step after the window, in steady state, under MemTracker
            return
        self.recording = n >= self.first
        if n >= self.first:
            self._steps.append(n)
        if n == self.first or (self._steps == [n] and n > self.first):  # a window entered late (a resume)
            self._sync_clock()

    def close(self) -> None:
        """The run ended inside the window (or in the memory step): write what was recorded."""
        if self._prof is not None:
            self._sched1 = _schedstat()
            self._finish()
        if getattr(self, "_mt", None) is not None or self._cmem is not None:
            self._memory_exit()

    def end_memory(self) -> None:
        """Before an evaluation: MemTracker follows one training step; a second pass through the
        module (eval's forward) would be an error in torch's tracker, and is not the step anyway."""
        if getattr(self, "_mt", None) is not None or self._cmem is not None:
            self._memory_exit()

    def _memory_enter(self, n: int) -> None:
        if not self.spec.memory or not hasattr(self, "_tracked"):
            return
        if self.ctx.device.type == "cuda":  # the allocator's own history: every block, at the GPU's peak
            return self._cuda_memory_enter(n)
        try:
            from torch.distributed._tools.mem_tracker import MemTracker

            mt = MemTracker()
            mt.track_external(*self._tracked)
            mt.__enter__()
            self._mt, self._mt_step, self._mt_forwards = mt, n, 0
        except Exception as e:  # a strategy MemTracker cannot follow: say so, keep training
            self._write_meta(memory_peak_bytes={"error": f"{type(e).__name__}: {e}"})

    def _cuda_memory_enter(self, n: int) -> None:
        from tandem.train.cuda_memory import CudaMemoryStep

        try:
            c = CudaMemoryStep(self.ctx.device, self.dir, *self._tracked)
            c.enter()
            self._cmem, self._mt_step = c, n
        except Exception as e:  # an allocator without history (another backend): say so, keep training
            self._write_meta(memory_peak_bytes={"error": f"{type(e).__name__}: {e}"})

    def _memory_exit(self) -> None:
        if self._cmem is not None:
            c, self._cmem = self._cmem, None
            try:
                extra = c.exit()
            except Exception as e:
                extra = {"memory_peak_bytes": {"error": f"{type(e).__name__}: {e}"}}
            self._write_meta(memory_step=self._mt_step, memory_capacity_bytes=_capacity(self.ctx.device), **extra)
            return
        mt, self._mt = self._mt, None
        try:
            mt.__exit__(None, None, None)
            snap, dev = mt.get_tracker_snapshot("peak"), self.ctx.device
            peak = snap.get(dev) or next((v for k, v in snap.items() if k.type == dev.type), {})  # cuda vs cuda:0
            mem = {getattr(k, "value", str(k)): int(v) for k, v in peak.items()}
        except Exception as e:
            mem = {"error": f"{type(e).__name__}: {e}"}
        self._write_meta(memory_peak_bytes=mem, memory_step=self._mt_step,
                         memory_capacity_bytes=_capacity(self.ctx.device))

    def _schedule(self, k: int):
        from torch.profiler import ProfilerAction as A

        if k == self.first - 1:
            return A.WARMUP
        if self.first <= k < self.last:
            return A.RECORD
        return A.RECORD_AND_SAVE if k == self.last else A.NONE

    def _start(self, n: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.ctx.device.type == "cuda" else [])
        self.dir.mkdir(parents=True, exist_ok=True)
        p = profile(activities=acts, schedule=self._schedule, record_shapes=self.spec.record_shapes,
                    on_trace_ready=self._export)
        p.step_num = n  # ProfilerStep#N numbers the trainer's steps, as metrics.jsonl does
        p.current_action = self._schedule(n)
        p.start()
        self._prof = p

    def _sync_clock(self) -> None:
        self._sched0, self._t0_ns = _schedstat(), time.time_ns()
        if not (dist.is_available() and dist.is_initialized()):
            return
        for _ in range(self.spec.clock_rounds):
            with torch.profiler.record_function(PREFIX + "clock"):
                dist.barrier()
            self._clock.append(time.time_ns())

    def _export(self, p) -> None:
        p.export_chrome_trace(str(self.dir / "trace.json.gz"))

    def _finish(self) -> None:
        p, self._prof, self.recording, self.on = self._prof, None, False, False
        t1_ns = time.time_ns()
        p.stop()
        fr = _flight_recorder(getattr(self, "_t0_ns", 0), t1_ns)
        (self.dir / "flight_recorder.json").write_text(json.dumps(fr))
        s0, s1 = getattr(self, "_sched0", None), getattr(self, "_sched1", None)
        sched = {k: s1[k] - s0[k] for k in s0} if s0 and s1 else None
        self._meta = {"schema": 1, "rank": self.ctx.rank, "world": self.ctx.world, "pid": os.getpid(),
                      "host": socket.gethostname(), "device": str(self.ctx.device), "backend": self.ctx.backend,
                      "device_name": (torch.cuda.get_device_name(self.ctx.device)
                                      if self.ctx.device.type == "cuda" else None),
                      "steps": self._steps, "clock_ns": self._clock, "trace": "trace.json.gz",
                      "main_thread_sched_ns": sched, "memory_peak_bytes": None, "memory_step": None}
        self._write_meta()

    def _write_meta(self, **extra) -> None:
        self._meta.update(extra)
        tmp = self.dir / "window.json.tmp"
        tmp.write_text(json.dumps(self._meta, indent=1))
        tmp.replace(self.dir / "window.json")


def _capacity(dev) -> int | None:
    """Memory this rank may use: its GPU's, or on CPU the host's RAM shared by the ranks on it."""
    try:
        if dev.type == "cuda":
            import torch

            return int(torch.cuda.get_device_properties(dev).total_memory)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(ram // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def _flight_recorder(lo_ns: int, hi_ns: int) -> dict:
    """torch's flight recorder (every process group, gloo included), the window's collectives only:
    per entry the group, its sequence number and when this rank enqueued it (Unix ns)."""
    try:
        import torch._C._distributed_c10d as c10d

        fr = json.loads(c10d._dump_fr_trace_json())
    except Exception as e:  # an older torch, or TORCH_FR_BUFFER_SIZE=0
        return {"error": f"{type(e).__name__}: {e}"}
    keep = ("pg_id", "collective_seq_id", "profiling_name", "input_sizes", "time_created_ns")
    ents = [{k: e.get(k) for k in keep} for e in fr.get("entries", [])
            if not e.get("is_p2p") and lo_ns <= int(e.get("time_created_ns", 0)) <= hi_ns]
    return {"entries": ents, "pg_status": fr.get("pg_status")}


def _schedstat() -> dict | None:
    """The calling thread's time on a CPU and waiting in a run queue (Linux /proc schedstat), in ns:
    a rank that is slow because its host gave it no CPU shows the wait here, a slow kernel does not."""
    try:
        on_cpu, queued, _ = (int(x) for x in open("/proc/thread-self/schedstat").read().split())
    except (OSError, ValueError):
        return None
    return {"on_cpu": on_cpu, "runqueue": queued, "wall": time.perf_counter_ns()}


class _Phase:
    """record_function, and NVTX on CUDA, for one phase inside the window."""

    __slots__ = ("name", "nvtx", "rf")

    def __init__(self, name: str, nvtx: bool) -> None:
        self.name, self.nvtx = name, nvtx

    def __enter__(self):
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        self.rf = torch.profiler.record_function(self.name)
        self.rf.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.rf.__exit__(*exc)
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
