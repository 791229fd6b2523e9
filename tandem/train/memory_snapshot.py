"""Peak memory by category from a CUDA memory snapshot (the step after the window, on GPUs).

The snapshot's reader sits with its writer: the trainer (tandem/train/cuda_memory.py) puts the
peak by category in window.json when it writes the files, and tandem diagnose (diagnose/trace.py)
reads them again from the run dir; both call ``peak_by_category``. It imports no torch. The trainer
runs that step with torch's allocator history on and writes, per rank:

    RUN_DIR/profile/rank-R/memory_snapshot.pickle   torch.cuda.memory._snapshot(): ``segments`` (the
                                                    blocks alive at the end) and ``device_traces`` (every
                                                    alloc / free_requested / free_completed of the step);
                                                    pytorch.org/memory_viz opens it as is
    RUN_DIR/profile/rank-R/memory_snapshot.json     the device index; "captures": the storage addresses
                                                    of the parameters, buffers, gradients and optimizer
                                                    state, taken when the optimizer phase begins (the
                                                    gradients exist then) and at the step's end, each
                                                    with the allocator's count of allocations so far;
                                                    that count at each phase boundary ("phases"); the
                                                    bytes allocated at the start and the allocator's peak

Replaying the trace gives the allocated bytes after every event; at the largest, each live block is
put in one of MemTracker's categories (so the rest of diagnose, and the plan comparison, read both
the same way): a block that held a known tensor when a capture was taken (the address matches and no
later allocation was made there before the capture) is that tensor's category (Parameter, Buffer,
Gradient, Optstate); any other block allocated during the forward is an
Activation, during the rest of the step a Temp; a block that was already allocated at the start and
is not a known tensor is Other. Sizes are the bytes each tensor asked for, as the trace records them;
``torch.cuda.max_memory_allocated`` counts the allocator's blocks (rounded up to 512 bytes; a large
block is not split when less than 1 MiB would remain), so the replayed peak is at most that, and
close (both are kept, as "check").
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

FORWARD = ("tandem.forward", "tandem.forward_backward")  # allocations there that outlive nothing known: activations
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Optstate", "Temp", "Other")


class _Plain(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: refuse anything else (a run dir is data)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"memory snapshot holds an object ({module}.{name}), not plain data")


def load_snapshot(path: Path) -> dict:
    return _Plain(io.BytesIO(Path(path).read_bytes())).load()


def _phase_of(k: int, marks: list) -> str:
    """The phase that was open at the k-th allocation (0-based) of the trace; marks are
    [[name or "", allocations before it], ...] in order."""
    name = ""
    for m, n in marks:
        if n > k:
            break
        name = m
    return name


def _at_start(trace: list, alive_end: dict[int, int]) -> dict:
    """Blocks allocated before the trace began: freed before any alloc at their address, or alive
    at the end without one. addr -> (size, "start", None)."""
    live, seen = {}, set()
    for e in trace:
        a = e.get("addr")
        if e["action"] == "alloc":
            seen.add(a)
        elif e["action"] in ("free_requested", "free_completed") and a not in seen and a not in live:
            live[a] = (int(e["size"]), "start", None)
    for a, size in alive_end.items():
        if a not in seen:
            live[a] = (size, "start", None)
    return live


def _replay(trace: list, live: dict, marks: list, stop: int | None = None):
    """Apply the trace's allocs and frees to ``live`` (addr -> (size, phase that allocated it, its
    allocation ordinal)) up to event ``stop`` (all: None). Returns live, and the index of the event after which the
    allocated total was largest (-1: at the start) with that total."""
    live = dict(live)
    cur = peak = sum(s for s, _, _ in live.values())
    peak_at, k, requested = -1, 0, set()
    for i, e in enumerate(trace if stop is None else trace[:stop + 1]):
        act, a = e["action"], e.get("addr")
        if act == "alloc":
            live[a] = (int(e["size"]), _phase_of(k, marks), k)
            k += 1
            cur += int(e["size"])
            if cur > peak:
                peak, peak_at = cur, i
        elif act == "free_requested" or (act == "free_completed" and a not in requested):
            # the allocator counts a block free at the request (a later free_completed only returns it
            # to the pool once other streams are done with it)
            if a in live:
                cur -= live.pop(a)[0]
            if act == "free_requested":
                requested.add(a)
        elif act == "free_completed":
            requested.discard(a)
    return live, peak_at, peak


def _known(addr: int, k: int | None, ords: list[int], captures: list) -> str | None:
    """The category of the block allocated at ``addr`` by allocation ``k`` (None: before the trace),
    if a capture named that address while this very block was the one there: the last allocation at
    the address before the capture is this block (an earlier or later block there is another tensor)."""
    for n, known in captures:
        if addr in known:
            before = [j for j in ords if j < n]
            if (before[-1] if before else None) == k:
                return known[addr]
    return None


def peak_by_category(snapshot: dict, info: dict) -> dict:
    """Bytes by MemTracker category at the step's largest allocated total, "Total" that total, and
    "check" {allocator_peak, replay_peak, start_allocated, start_derived, events} for the evidence."""
    dev = int(info.get("device", 0))
    traces = snapshot.get("device_traces") or []
    trace = [e for e in (traces[dev] if dev < len(traces) else []) if "action" in e]
    # the trace's sizes are the bytes each tensor asked for (the allocator's blocks are rounded up):
    # the blocks alive at the end are counted the same way
    alive_end = {int(b["address"]): int(b.get("requested_size") or b["size"]) for s in snapshot.get("segments", [])
                 if int(s.get("device", dev)) == dev for b in s.get("blocks", []) if b.get("state") != "inactive"}
    start_live = _at_start(trace, alive_end)
    start_derived = sum(s for s, _, _ in start_live.values())
    marks = info.get("phases") or []
    _, peak_at, replay_peak = _replay(trace, start_live, marks)
    at_peak, _, _ = _replay(trace, start_live, marks, stop=peak_at)
    ordinals: dict[int, list[int]] = {}  # addr -> the allocation ordinals made there, in order
    for k, e in enumerate(e for e in trace if e["action"] == "alloc"):
        ordinals.setdefault(e.get("addr"), []).append(k)
    captures = [(int(c["allocs"]), {int(a): cat for cat, addrs in c["tensors"].items() for a in addrs})
                for c in info.get("captures") or []]
    out = dict.fromkeys(CATEGORIES, 0)
    for a, (size, origin, k) in at_peak.items():
        cat = _known(a, k, ordinals.get(a, []), captures)
        if cat is None:
            cat = "Other" if origin == "start" else ("Activation" if origin in FORWARD else "Temp")
        out[cat] += size
    out["Total"] = sum(out[c] for c in CATEGORIES)
    out["check"] = {"allocator_peak": info.get("allocator_peak"), "replay_peak": replay_peak,
                    "start_allocated": info.get("allocated_at_start"), "start_derived": start_derived,
                    "events": len(trace)}
    return out


def read(rank_dir: Path) -> dict | None:
    """A rank's snapshot files -> MemTracker-style bytes by category (and "check"), or {"error"}."""
    info_p = Path(rank_dir) / "memory_snapshot.json"
    if not info_p.exists():
        return None
    try:
        info = json.loads(info_p.read_text())
        if "error" in info:
            return {"error": info["error"]}
        snap = load_snapshot(Path(rank_dir) / info.get("snapshot", "memory_snapshot.pickle"))
        return peak_by_category(snap, info)
    except (OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError, EOFError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
