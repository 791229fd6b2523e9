"""Per-rank peak memory of a run: what the model, its gradients, optimizer state and activations took.

    mem = PeakMemory(ctx.device)     # before the model is built: the baseline
    ...                              # build, parallelize, train
    record = mem.gather(ctx)         # collective: every rank's peak, in rank order

On a GPU: ``torch.cuda.max_memory_allocated`` (the caching allocator's peak of live tensors;
reset here, so the baseline is what was allocated before the build). On the CPU: the process's
resident-set high-water mark (``VmHWM`` in ``/proc/self/status``), which also counts the Python
and torch runtime, loaded libraries and the process group's buffers: the baseline is the
resident set when the run starts, and the peak is reset to it there (``/proc/self/clear_refs``),
so ``peak - baseline`` is what the run added at its highest. That difference is what ``tandem
plan``'s per-GPU memory predicts, less the CUDA context (``bench/meta_memory.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    return _status_kb("VmRSS")


def peak_rss_bytes() -> int | None:
    v = _status_kb("VmHWM")
    if v is None:  # not Linux: getrusage's maximum resident set (kB on Linux, bytes on macOS)
        import resource
        import sys
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        v = r if sys.platform == "darwin" else r * 1024
    return v


def reset_peak_rss() -> bool:
    """Set the high-water mark back to the current resident set (Linux 4.0+); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakMemory:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.device, self.baseline = device, torch.cuda.memory_allocated(device)
        else:
            self.reset = reset_peak_rss()
            self.baseline = rss_bytes() or 0

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes() or 0

    def local(self) -> dict:
        peak = self.peak()
        return {"kind": "cuda_max_allocated" if self.cuda else "rss_hwm", "peak_bytes": peak,
                "baseline_bytes": self.baseline, "run_bytes": peak - self.baseline}

    def gather(self, ctx) -> dict:
        """Every rank's record as lists in rank order (one all-gather); on one process, its own."""
        import torch.distributed as dist

        mine = self.local()
        if not dist.is_initialized() or ctx.world == 1:
            return {k: (v if k == "kind" else [v]) for k, v in mine.items()}
        allr: list = [None] * ctx.world
        dist.all_gather_object(allr, mine)
        return {"kind": mine["kind"], **{k: [r[k] for r in allr] for k in ("peak_bytes", "baseline_bytes",
                                                                         "run_bytes")}}
