"""Where one rank's step goes: exclusive data / compute / exposed communication / idle shares.

Every instant of a step (``ProfilerStep#N`` minus the ``tandem.clock`` barriers) gets exactly one
category, first match wins:

    data      inside ``tandem.data`` (the loader's ``__next__``, or the wait for its workers)
    compute   the main thread is inside an op (``cpu_op``, c10d's own ops excluded)
    comm      a collective is open (a ``gloo:*``/``nccl:*`` span, or the main thread inside a
              ``c10d::*`` op) and the main thread computes nothing: exposed communication
    compute   the main thread is between ops inside a trainer phase (Python running)
    idle      anything else (outside the phases, nothing open)

so the four add up to the step time exactly. Overlap is HTA's: the part of the communication
time during which the main thread computed, over the communication time.

When the trace holds the GPU's timeline (CUDA kernels), the shares are the GPU's, as HTA reads
them, over the same step window (tandem's trainer reads the loss and gradient norm every step, so
a step's kernels end inside it):

    compute   a compute kernel runs on any stream (or a device-side memcpy / memset)
    comm      an ``nccl*`` kernel (or a gloo collective) runs and no compute kernel does: exposed
    data      a host-to-device copy runs, or the main thread is inside ``tandem.data``, GPU idle
    idle      the GPU does nothing else: launch overhead, Python, waits

and overlap is HTA's on kernels: the time compute kernels run during nccl kernels, over the nccl
kernels' time. The sections stay the main thread's (the phases are CPU ranges). Each instant also
belongs to the innermost ``tandem.<phase>`` range around it; a section's time is its data,
compute and idle time, its exposed communication left out (waiting makes fast ranks look slow).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from tandem.diagnose.trace import PHASE_PREFIX, RankTrace, Span

CATEGORIES = ("data", "compute", "comm", "idle")


def merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


class _Cover:
    """Membership of a point in a union of intervals, by bisection."""

    def __init__(self, spans) -> None:
        self.iv = merge(spans)
        self.starts = [a for a, _ in self.iv]

    def __contains__(self, t: float) -> bool:
        i = bisect_right(self.starts, t) - 1
        return i >= 0 and t < self.iv[i][1]

    def bounds(self) -> list[float]:
        return [x for iv in self.iv for x in iv]


@dataclass
class StepShare:
    step: int
    step_us: float
    us: dict[str, float]                       # category -> exclusive us
    comm_us: float                             # all communication time (exposed + overlapped)
    overlap_us: float
    sections_us: dict[str, float] = field(default_factory=dict)   # phase -> us, exposed comm left out
    collectives: list[Span] = field(default_factory=list)         # the collective spans that start in it
    source: str = "cpu"                                           # cpu | gpu_kernels: where the shares come from

    def pct(self, cat: str) -> float:
        return 100.0 * self.us[cat] / self.step_us if self.step_us else 0.0

    @property
    def overlap_pct(self) -> float:
        return 100.0 * self.overlap_us / self.comm_us if self.comm_us else 0.0

    def to_dict(self) -> dict:
        return {"step": self.step, "step_ms": round(self.step_us / 1e3, 3),
                **{f"{c}_pct": round(self.pct(c), 3) for c in CATEGORIES},
                **{f"{c}_ms": round(self.us[c] / 1e3, 3) for c in CATEGORIES},
                "comm_total_ms": round(self.comm_us / 1e3, 3), "overlap_pct": round(self.overlap_pct, 2),
                "sections_ms": {k: round(v / 1e3, 3) for k, v in sorted(self.sections_us.items())},
                "collectives": len(self.collectives), "shares_from": self.source}


def _clip(spans, a: float, b: float) -> list[tuple[float, float]]:
    return [(max(s.start, a), min(s.end, b)) for s in spans if s.end > a and s.start < b]


def step_share(t: RankTrace, step: int) -> StepShare:
    a, b = t.steps[step]
    clock = _Cover(_clip([p for p in t.phases if p.name == PHASE_PREFIX + "clock"], a, b))
    data = _Cover(_clip([p for p in t.phases if p.name == PHASE_PREFIX + "data"], a, b))
    c10d = _clip(t.c10d, a, b)
    ops = _Cover(_clip(t.ops, a, b))
    issue = _Cover(c10d)
    comm = _Cover(_clip(t.comms, a, b) + c10d)
    phases = [p for p in t.phases if p.end > a and p.start < b and p.name not in (PHASE_PREFIX + "clock",)]
    phase_cover = _Cover(_clip(phases, a, b))
    cuts = sorted({a, b, *(x for c in (clock, data, ops, issue, comm, phase_cover) for x in c.bounds()
                           if a < x < b)})
    us = dict.fromkeys(CATEGORIES, 0.0)
    sections: dict[str, float] = {}
    comm_us = overlap = 0.0
    for lo, hi in zip(cuts, cuts[1:]):
        mid, dt = (lo + hi) / 2, hi - lo
        if mid in clock:
            continue
        busy = mid in ops and mid not in issue
        in_comm = mid in comm
        if in_comm:
            comm_us += dt
            overlap += dt if busy else 0.0
        if mid in data:
            cat = "data"
        elif busy:
            cat = "compute"
        elif in_comm:
            cat = "comm"
        elif mid in phase_cover:
            cat = "compute"
        else:
            cat = "idle"
        us[cat] += dt
        if cat != "comm":
            sec = _innermost(phases, mid)
            sections[sec] = sections.get(sec, 0.0) + dt
    colls = [c for c in t.comms if a <= c.start < b]
    if t.has_gpu:
        us, comm_us, overlap = _gpu_shares(t, a, b, clock, data)
        return StepShare(step, sum(us.values()), us, comm_us, overlap, sections, colls, "gpu_kernels")
    return StepShare(step, sum(us.values()), us, comm_us, overlap, sections, colls)


def _htod(s: Span) -> bool:
    return s.name.startswith("Memcpy HtoD")


def _gpu_shares(t: RankTrace, a: float, b: float, clock: _Cover, data: _Cover):
    """The step's instants by what the GPU does (module docstring); -> (us, comm_us, overlap_us)."""
    kern = _Cover(_clip(t.kernels, a, b))
    busy = _Cover(_clip(t.kernels + [m for m in t.gpu_mem if not _htod(m)], a, b))
    h2d = _Cover(_clip([m for m in t.gpu_mem if _htod(m)], a, b))
    comm = _Cover(_clip(t.gpu_comm + [c for c in t.comms if c.name.startswith("gloo:")], a, b))
    cuts = sorted({a, b, *(x for c in (clock, data, kern, busy, h2d, comm) for x in c.bounds() if a < x < b)})
    us = dict.fromkeys(CATEGORIES, 0.0)
    comm_us = overlap = 0.0
    for lo, hi in zip(cuts, cuts[1:]):
        mid, dt = (lo + hi) / 2, hi - lo
        if mid in clock:
            continue
        if mid in comm:
            comm_us += dt
            overlap += dt if mid in kern else 0.0
        cat = ("compute" if mid in busy else "comm" if mid in comm else "data" if mid in h2d or mid in data
               else "idle")
        us[cat] += dt
    return us, comm_us, overlap


def _innermost(phases: list[Span], t: float) -> str:
    best = None
    for p in phases:
        if p.start <= t < p.end and (best is None or p.start >= best.start):
            best = p
    return best.name[len(PHASE_PREFIX):] if best else "other"


def rank_shares(t: RankTrace) -> list[StepShare]:
    return [step_share(t, n) for n in sorted(t.steps)]
