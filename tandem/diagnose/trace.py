"""Read the per-rank profiler windows a run wrote (tandem/train/profile.py) into plain interval lists.

Only what the analysis needs is kept, in microseconds on the rank's own clock (trace ``ts``
shifted by the difference of the files' ``baseTimeNanoseconds``, so ranks whose exporters chose
different bases still share one origin): the steps, the main thread's ops and tandem ranges, and
every collective span. What each holds on torch 2.13 is written down in docs/diagnose.md.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem.core.errors import DataError
from tandem.core import rundir
from tandem.train import memory_snapshot

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
# the GPU timeline in torch's (Kineto's) Chrome trace: pid = the device, tid = the stream, args carry
# "device", "stream" and the "correlation" of the launching cudaLaunchKernel; "cuda_sync" and
# "gpu_user_annotation" events on the same timeline are waits and labels, not work
_GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
PHASE_PREFIX = "tandem."
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
                "unsigned char": 1, "signed char": 1, "bool": 1, "short int": 2}


@dataclass
class Span:
    name: str
    start: float        # us
    end: float
    tid: object = 0
    nbytes: int = 0     # collectives with record_shapes: the tensor's size

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class RankTrace:
    rank: int
    steps: dict[int, tuple[float, float]]          # step number -> (start, end) of ProfilerStep#N
    ops: list[Span] = field(default_factory=list)       # main-thread cpu_op events (compute), c10d ops excluded
    c10d: list[Span] = field(default_factory=list)      # main-thread c10d::* ops (issue, and wait for sync ones)
    phases: list[Span] = field(default_factory=list)    # tandem.* ranges on the main thread
    comms: list[Span] = field(default_factory=list)     # gloo:* / nccl:* collective spans, any thread
    kernels: list[Span] = field(default_factory=list)   # GPU compute kernels (cat "kernel"), any stream
    gpu_comm: list[Span] = field(default_factory=list)  # nccl* kernels on the GPU timeline
    gpu_mem: list[Span] = field(default_factory=list)   # GPU memcpy / memset ("Memcpy HtoD ...": a batch in)
    raw: list[dict] = field(default_factory=list)       # the trace's events, for the merged trace
    meta: dict = field(default_factory=dict)            # window.json
    base_us: float = 0.0                                # this file's baseTimeNanoseconds / 1000
    header: dict = field(default_factory=dict)          # the file's other top-level keys (distributedInfo, ...)

    def shift(self, by: float) -> "RankTrace":
        """The same trace with every time moved by ``by`` us (synthetic tests; clock alignment)."""
        mv = lambda xs: [Span(s.name, s.start + by, s.end + by, s.tid, s.nbytes) for s in xs]  # noqa: E731
        return replace(self, steps={k: (a + by, b + by) for k, (a, b) in self.steps.items()},
                       ops=mv(self.ops), c10d=mv(self.c10d), phases=mv(self.phases), comms=mv(self.comms),
                       kernels=mv(self.kernels), gpu_comm=mv(self.gpu_comm), gpu_mem=mv(self.gpu_mem))

    @property
    def has_gpu(self) -> bool:
        return bool(self.kernels or self.gpu_comm)


def _prod(dims: list) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _nbytes(args: dict) -> int:
    """The first input's bytes: a gloo span's tensor, or the sum of a c10d op's tensor list (whose
    dtype the trace does not give: 4 bytes, as DDP's fp32 gradient buckets)."""
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    if not dims or not isinstance(dims[0], list):
        return 0
    if dims[0] and all(isinstance(d, list) for d in dims[0]):
        return 4 * sum(_prod(d) for d in dims[0])
    if any(isinstance(d, list) for d in dims[0]):
        return 0
    return _prod(dims[0]) * _DTYPE_BYTES.get(types[0] if types else "float", 4)


def is_comm(name: str) -> bool:
    return name.startswith(("gloo:", "nccl:")) or (name.startswith("nccl") and "Kernel" in name)


def parse(doc: dict, rank: int, meta: dict | None = None, origin_us: float | None = None) -> RankTrace:
    """One rank's Chrome trace (the dict torch exported) -> RankTrace. ``origin_us``: the base
    all ranks are put on (rank 0's baseTimeNanoseconds / 1000); None keeps this file's."""
    events = doc.get("traceEvents", [])
    base = float(doc.get("baseTimeNanoseconds", 0)) / 1000.0
    shift = 0.0 if origin_us is None else base - origin_us
    main = (meta or {}).get("pid")
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if main is None:  # the process's main thread holds ProfilerStep#N
        main = next((e.get("pid") for e in xs if _STEP.match(e.get("name", ""))), None)
    steps: dict[int, tuple[float, float]] = {}
    t = RankTrace(rank, steps, raw=events, meta=meta or {}, base_us=base,
                  header={k: v for k, v in doc.items() if k != "traceEvents"})
    for e in xs:
        name, ts = e.get("name", ""), float(e["ts"]) + shift
        sp = Span(name, ts, ts + float(e["dur"]), e.get("tid"))
        on_main = e.get("tid") == main
        cat = e.get("cat")
        if cat in _GPU_WORK:
            if cat == "kernel" and name.startswith("nccl"):
                t.gpu_comm.append(sp)
            else:
                (t.kernels if cat == "kernel" else t.gpu_mem).append(sp)
            if not is_comm(name):
                continue
        m = _STEP.match(name)
        if m and on_main:
            steps[int(m.group(1))] = (sp.start, sp.end)
        elif is_comm(name):
            sp.nbytes = _nbytes(e.get("args") or {})
            t.comms.append(sp)
        elif not on_main:
            continue
        elif name.startswith(PHASE_PREFIX):
            t.phases.append(sp)
        elif name.startswith("c10d::"):
            sp.nbytes = _nbytes(e.get("args") or {})
            t.c10d.append(sp)
        elif e.get("cat") == "cpu_op":
            t.ops.append(sp)
    for lst in (t.ops, t.c10d, t.phases, t.comms, t.kernels, t.gpu_comm, t.gpu_mem):
        lst.sort(key=lambda s: (s.start, -s.end))
    return t


def load_run(run_dir: Path) -> list[RankTrace]:
    """Every rank's window under RUN_DIR/profile, on rank 0's time base; errors name the fix."""
    root = Path(run_dir) / rundir.PROFILE
    dirs = sorted(root.glob("rank-*"), key=lambda p: int(p.name.split("-")[1])) if root.is_dir() else []
    if not dirs:
        raise DataError("no profiler window in this run", field="run_dir", value=str(run_dir),
                        fix="train with --profile.enabled true (and --profile.start_step N below the run's "
                            "steps), then run tandem diagnose on that run dir")
    docs = []
    for d in dirs:
        rank = int(d.name.split("-")[1])
        meta_p, trace_p = d / "window.json", d / "trace.json.gz"
        if not trace_p.exists():
            raise DataError("rank's profiler trace is missing (the run ended before its window closed?)",
                            field="run_dir", value=str(trace_p),
                            fix="profile steps the run reaches: lower --profile.start_step or --profile.steps")
        meta = json.loads(meta_p.read_text()) if meta_p.exists() else {}
        if (d / "flight_recorder.json").exists():
            meta["flight_recorder"] = json.loads((d / "flight_recorder.json").read_text())
        snap = memory_snapshot.read(d)  # on GPUs: the allocator's snapshot instead of MemTracker's peak
        if snap is not None:
            meta["memory_check"] = snap.pop("check", None)
            meta["memory_peak_bytes"], meta["memory_source"] = snap, "cuda_snapshot"
        doc = json.loads(gzip.decompress(trace_p.read_bytes()))
        props = doc.get("deviceProperties") or []  # torch's trace names the GPUs it saw
        if not meta.get("device_name") and str(meta.get("device", "")).startswith("cuda") and props:
            meta["device_name"] = props[0].get("name")
        docs.append((rank, doc, meta))
    origin = float(docs[0][1].get("baseTimeNanoseconds", 0)) / 1000.0
    return [parse(doc, rank, meta, origin) for rank, doc, meta in docs]
