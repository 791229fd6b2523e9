"""One step under torch's CUDA allocator history: the GPU's counterpart of the MemTracker step.

    step = CudaMemoryStep(device, out_dir, model, optim)
    step.enter()                      # the step after the profiler window
    with step.phase("tandem.forward"): ...
    step.exit()                       # writes memory_snapshot.pickle and memory_snapshot.json; returns
                                      # the peak by category for window.json (as MemTracker's)

The pickle is ``torch.cuda.memory._snapshot()`` as torch writes it (pytorch.org/memory_viz opens it);
the JSON holds what the allocator cannot know: which addresses are parameters, buffers, gradients
and optimizer state (when the optimizer phase begins, and at the step's end), and how many
allocations the allocator had made when each phase began (its own counter, so the k-th ``alloc``
of the trace is placed in its phase without timestamps). memory_snapshot.py turns both into the peak by category.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path

import torch

from tandem.train.memory_snapshot import peak_by_category

MAX_ENTRIES = 1_000_000   # trace entries kept (a ring): far more than one step allocates


def _allocs(dev) -> int:
    return int(torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0))


def _addr(t) -> int | None:
    """The allocator block holding a tensor: its storage's base (a view, e.g. a gradient in DDP's
    bucket, names the bucket). DTensors (FSDP2) by their local shard."""
    if t is None:
        return None
    if hasattr(t, "to_local"):
        t = t.to_local()
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        return None
    return int(t.untyped_storage().data_ptr()) or None


def tensor_addresses(model, optim) -> dict[str, list[int]]:
    """Block addresses of the model's parameters, buffers and gradients and the optimizer's state."""
    cats: dict[str, set[int]] = {"Parameter": set(), "Buffer": set(), "Gradient": set(), "Optstate": set()}
    for p in model.parameters():
        cats["Parameter"].add(_addr(p))
        cats["Gradient"].add(_addr(p.grad))
    for b in model.buffers():
        cats["Buffer"].add(_addr(b))
    for st in (optim.state.values() if optim is not None else ()):
        for v in st.values():
            cats["Optstate"].add(_addr(v))
    return {k: sorted(a for a in v if a) for k, v in cats.items()}


class CudaMemoryStep:
    def __init__(self, device, out_dir: Path, model, optim) -> None:
        self.dev, self.dir, self.model, self.optim = device, Path(out_dir), model, optim
        self.marks: list[list] = []
        self.captures: list[dict] = []

    def enter(self) -> None:
        torch.cuda.synchronize(self.dev)
        torch.cuda.reset_peak_memory_stats(self.dev)
        self.start = torch.cuda.memory_allocated(self.dev)
        # context "alloc", python stacks: each allocation's Python stack, for memory_viz; no C++ unwinding
        torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                                 max_entries=MAX_ENTRIES, device=self.dev)
        self.base = _allocs(self.dev)

    def capture(self) -> None:
        """The known tensors' addresses now (gradients exist from the backward to the optimizer's
        zero_grad), with the allocations made so far: the reader matches them to blocks."""
        self.captures.append({"allocs": _allocs(self.dev) - self.base,
                              "tensors": tensor_addresses(self.model, self.optim)})

    @contextlib.contextmanager
    def phase(self, name: str, nvtx: bool = False):
        if name.endswith(".optimizer"):
            self.capture()
        self.marks.append([name, _allocs(self.dev) - self.base])
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()
            self.marks.append(["", _allocs(self.dev) - self.base])

    def exit(self) -> dict:
        """Stop recording and write both files; returns what window.json keeps."""
        torch.cuda.synchronize(self.dev)
        self.capture()
        peak = torch.cuda.max_memory_allocated(self.dev)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None, device=self.dev)
        (self.dir / "memory_snapshot.pickle").write_bytes(pickle.dumps(snap))
        idx = torch.device(self.dev).index
        info = {"schema": 1, "snapshot": "memory_snapshot.pickle",
                "device": torch.cuda.current_device() if idx is None else idx,
                "allocated_at_start": self.start, "allocator_peak": peak, "phases": self.marks,
                "captures": self.captures}
        (self.dir / "memory_snapshot.json").write_text(json.dumps(info))
        cats = peak_by_category(snap, info)
        return {"memory_source": "cuda_snapshot", "memory_peak_bytes": {k: v for k, v in cats.items() if k != "check"},
                "memory_check": cats["check"]}
