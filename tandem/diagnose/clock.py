"""Put every rank on rank 0's clock.

Two estimates of each rank's offset (its clock minus rank 0's), both from events that end at the
same true moment on every rank:

1. the barriers at the window's start: the ``tandem.clock`` ranges end when the barrier lets every
   rank go (the trainer runs ``profile.clock_rounds`` of them);
2. the matched collectives: the k-th collective of one kind on every rank (one process group issues
   them in the same order everywhere). A rank may *start* one late (that is what lateness
   measures), but an all-reduce *ends* on all ranks together, within one message's latency.

Each estimate is the median over its events of (end on rank r - end on rank 0): robust to the one
collective whose end a descheduled thread recorded late. The collectives refine the barriers when
at least ``MIN_MATCHED`` matched. The residual is the median distance of the matched ends from
the fitted offset, the largest over ranks: no cross-rank claim is made below it.

Ranks whose window.json names one host share one clock (the profiler stamps Unix time): their
offsets are 0 ("one-host"), the estimates kept beside them (``estimated_us``) as a measure of the
method's own error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from tandem.diagnose.trace import PHASE_PREFIX, RankTrace, Span

MIN_MATCHED = 3
_ALIGNING = ("all_reduce", "allreduce", "barrier", "all_gather", "allgather", "reduce_scatter")


@dataclass
class Clock:
    method: str                                   # collectives | barriers | one-host | none
    offsets_us: dict[int, float]                  # rank -> its clock minus rank 0's
    residual_us: float
    barrier_offsets_us: dict[int, float] = field(default_factory=dict)
    matched: int = 0                              # collectives matched on every rank
    estimated_us: dict[int, float] = field(default_factory=dict)  # one-host: what the collectives estimated

    def to_dict(self) -> dict:
        return {"method": self.method, "offsets_us": {str(k): round(v, 3) for k, v in self.offsets_us.items()},
                "residual_us": round(self.residual_us, 3),
                "barrier_offsets_us": {str(k): round(v, 3) for k, v in self.barrier_offsets_us.items()},
                "matched_collectives": self.matched,
                "estimated_offsets_us": {str(k): round(v, 3) for k, v in self.estimated_us.items()}}


def clock_marks(t: RankTrace) -> list[float]:
    return [p.end for p in t.phases if p.name == PHASE_PREFIX + "clock"]


def match_collectives(traces: list[RankTrace]) -> list[list[Span]]:
    """Collectives matched across ranks by kind and order: [[span of rank 0, rank 1, ...], ...].

    Counting starts at the window's first clock barrier, which every rank enters at the same step
    (a collective still in flight from the step before, recorded on one rank only, would shift the
    order). The window closes at slightly different moments on each rank, so the last few of a kind
    may be missing on some: the common prefix is kept."""
    by_kind: list[dict[str, list[Span]]] = []
    for t in traces:
        marks = [p.start for p in t.phases if p.name == PHASE_PREFIX + "clock"]
        first = min(marks) if marks else float("-inf")
        kinds: dict[str, list[Span]] = {}
        for c in t.comms:
            if c.start >= first:
                kinds.setdefault(c.name, []).append(c)
        by_kind.append(kinds)
    out = []
    for name in by_kind[0]:
        lists = [k.get(name, []) for k in by_kind]
        out.extend([list(group) for group in zip(*lists)])
    return sorted(out, key=lambda g: g[0].start)


def _median_diff(a: list[float], b: list[float]) -> float | None:
    d = [x - y for x, y in zip(a, b)]
    return median(d) if d else None


def estimate(traces: list[RankTrace]) -> Clock:
    ranks = [t.rank for t in traces]
    zero = {r: 0.0 for r in ranks}
    if len(traces) < 2:
        return Clock("none", zero, 0.0)
    marks = [clock_marks(t) for t in traces]
    barrier = {}
    if all(len(m) == len(marks[0]) and m for m in marks):
        barrier = {t.rank: _median_diff(m, marks[0]) for t, m in zip(traces, marks)}
    groups = [g for g in match_collectives(traces) if any(k in g[0].name for k in _ALIGNING)]
    hosts = {t.meta.get("host") for t in traces}
    if len(groups) >= MIN_MATCHED:
        offsets = {t.rank: median(g[i].end - g[0].end for g in groups) for i, t in enumerate(traces)}
        method = "collectives"
        if len(hosts) == 1 and None not in hosts:  # one host, one clock: the estimate's error is all it would add
            estimated, offsets, method = offsets, zero, "one-host"
        else:
            estimated = {}
        resid = max(median(abs(g[i].end - g[0].end - offsets[t.rank]) for g in groups)
                    for i, t in enumerate(traces))
        return Clock(method, offsets, resid, barrier, len(groups), estimated)
    if barrier:
        resid = max(median(abs(a - b - barrier[t.rank]) for a, b in zip(m, marks[0]))
                    for t, m in zip(traces, marks))
        return Clock("barriers", barrier, resid, barrier, 0)
    return Clock("none", zero, float("inf"))


def lateness(traces: list[RankTrace], clock: Clock) -> dict[int, list[tuple[float, float]]]:
    """Per rank, how late (us, aligned clock) it arrived at each matched collective: start minus the
    earliest rank's start, with that earliest start: [(when, late), ...]. The ranks that arrive early
    may wait that long inside the collective."""
    out: dict[int, list[tuple[float, float]]] = {t.rank: [] for t in traces}
    for g in match_collectives(traces):
        starts = [s.start - clock.offsets_us[t.rank] for s, t in zip(g, traces)]
        first = min(starts)
        for t, s in zip(traces, starts):
            out[t.rank].append((first, s - first))
    return out


def fr_lateness(traces: list[RankTrace], clock: Clock) -> dict[int, list[tuple[float, float]]] | None:
    """Lateness from torch's flight recorder: the same collective (process group, sequence number)
    on every rank, its enqueue time (Unix ns) put on the trace clock and aligned; None without it."""
    frs = [(t.meta.get("flight_recorder") or {}).get("entries") for t in traces]
    if not traces or any(f is None for f in frs):
        return None
    origin = traces[0].base_us
    created = [{(e["pg_id"], e["collective_seq_id"]): e["time_created_ns"] / 1000.0 - origin - clock.offsets_us[t.rank]
                for e in f} for t, f in zip(traces, frs)]
    common = set.intersection(*(set(c) for c in created))
    out: dict[int, list[tuple[float, float]]] = {t.rank: [] for t in traces}
    for key in sorted(common):
        first = min(c[key] for c in created)
        for t, c in zip(traces, created):
            out[t.rank].append((first, c[key] - first))
    return out
