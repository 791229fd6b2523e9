"""From the ranks' traces to the report: clock, per-step shares, section scores, lateness, verdicts.

The result is a plain dict, the content of ``diagnose.json`` (schema ``SCHEMA``; docs/diagnose.md
lists its fields). Rendering lives in report.py, the advice in verdicts.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from statistics import median

from tandem.diagnose import against_plan, efficiency, steptime, whatif
from tandem.diagnose.breakdown import CATEGORIES, StepShare, rank_shares
from tandem.diagnose.clock import Clock, estimate, fr_lateness, lateness
from tandem.diagnose.trace import PHASE_PREFIX, RankTrace
from tandem.diagnose.verdicts import judge, weigh
from tandem.core import rundir

SCHEMA = "tandem.diagnose/1"
STRAGGLER_SCORE = 0.75      # fastest rank's median / this rank's median, below it: a straggler (NVRx's rule)
STRAGGLER_MIN_FRAC = 0.05   # ...and slower by at least this fraction of the median step (no alarms on noise)
STRAGGLER_MIN_US = 500.0    # ...and by this much: a shared CPU's scheduler moves sub-ms sections by more
STRAGGLER_STEPS = 0.75      # ...in this share of the window's steps each (a burst of load on some steps is not)
_GRAD_PHASES = (PHASE_PREFIX + "backward", PHASE_PREFIX + "forward_backward")


def _med(xs) -> float:
    xs = list(xs)
    return median(xs) if xs else 0.0


def ddp_buckets(t: RankTrace, step: int) -> list[int]:
    """Bytes of each gradient all-reduce the backward issued in this step (DDP's buckets, in order)."""
    a, b = t.steps[step]
    grad = [p for p in t.phases if p.name in _GRAD_PHASES and p.end > a and p.start < b]
    return [c.nbytes for c in t.c10d if c.name == "c10d::allreduce_" and a <= c.start < b
            and any(p.start <= c.start < p.end for p in grad)]


def _late(late: list[tuple[float, float]] | None, steps: list[tuple[float, float]], clock: Clock) -> dict | None:
    """``per_step``: the mean over steps of the step's largest lateness, a lower bound on how long the
    others waited for this rank each step (lateness at successive collectives of one step can repeat
    one delay: a broadcast's root does not wait)."""
    if late is None:
        return None
    xs = [x for _, x in late]
    worst = [max((x for w, x in late if a <= w < b), default=0.0) for a, b in steps]
    return {"per_step": round(_med(worst) / 1e3, 3) if worst else 0.0, "median": round(_med(xs) / 1e3, 3),
            "max": round(max(xs, default=0.0) / 1e3, 3), "collectives": len(xs),
            "above_residual": sum(x > clock.residual_us for x in xs)}


def _rank_summary(t: RankTrace, shares: list[StepShare], late_us: list, clock: Clock, fr_us: list | None,
                  steps: list[tuple[float, float]]) -> dict:
    buckets = [ddp_buckets(t, s.step) for s in shares]
    per_step = [len(b) for b in buckets]
    sizes = [x for b in buckets for x in b]
    sched = t.meta.get("main_thread_sched_ns") or {}
    n = max(1, len(t.meta.get("steps") or shares))
    return {
        "rank": t.rank,
        "main_thread": ({"runqueue_ms_per_step": round(sched["runqueue"] / n / 1e6, 3),
                         "on_cpu_ms_per_step": round(sched["on_cpu"] / n / 1e6, 3)} if sched else None),
        "memory": _memory(t.meta),
        "steps": [s.to_dict() for s in shares],
        "median": {"step_ms": round(_med(s.step_us for s in shares) / 1e3, 3),
                   **{f"{c}_pct": round(_med(s.pct(c) for s in shares), 2) for c in CATEGORIES},
                   "overlap_pct": round(_med(s.overlap_pct for s in shares), 2),
                   "shares_from": shares[0].source if shares else "cpu"},
        "collectives": {"per_step": _med(len(s.collectives) for s in shares),
                        "grad_allreduce_per_step": _med(per_step),
                        "grad_bucket_bytes_median": int(_med(sizes)),
                        "grad_bytes_per_step": int(_med(sum(b) for b in buckets))},
        "lateness_ms": _late(late_us, steps, clock),            # gloo/nccl spans' starts, matched by order
        "fr_lateness_ms": _late(fr_us, steps, clock),          # flight recorder: enqueue times, by seq id
        "comm_spans": {"median_ms": round(_med(c.dur for s in shares for c in s.collectives) / 1e3, 3),
                       "grad_MBps": round(_med(c.nbytes / c.dur for s in shares for c in s.collectives
                                               if c.nbytes >= 1024 and c.dur > 0), 1)},
    }


def _memory(meta: dict) -> dict | None:
    """The peak by category for the one tracked step (MiB; MemTracker's, or on GPUs the CUDA
    snapshot's), or its error."""
    peak = meta.get("memory_peak_bytes")
    if not peak:
        return None
    if "error" in peak:
        return {"error": peak["error"]}
    out = {"step": meta.get("memory_step"), "peak_mib": {k: round(v / (1 << 20), 3) for k, v in peak.items()},
           "capacity_bytes": meta.get("memory_capacity_bytes"), "source": meta.get("memory_source", "memtracker")}
    if meta.get("memory_check"):
        out["check"] = meta["memory_check"]
    return out


def section_scores(shares: dict[int, list[StepShare]]) -> dict:
    """Per section, each rank's median time and score (fastest median / its median), and stragglers."""
    names = sorted({k for ss in shares.values() for s in ss for k in s.sections_us} - {"other"})
    step_med = _med(s.step_us for ss in shares.values() for s in ss)
    med = {r: {n: _med(s.sections_us.get(n, 0.0) for s in ss) for n in names} for r, ss in shares.items()}
    out: dict = {"median_ms": {}, "scores": {}, "stragglers": []}
    for n in names:
        fastest = min(m[n] for m in med.values())
        for r, m in med.items():
            score = fastest / m[n] if m[n] > 0 else 1.0
            out["median_ms"].setdefault(str(r), {})[n] = round(m[n] / 1e3, 3)
            out["scores"].setdefault(str(r), {})[n] = round(score, 3)
            floor = fastest + max(STRAGGLER_MIN_FRAC * step_med, STRAGGLER_MIN_US)
            slow_steps = sum(s.sections_us.get(n, 0.0) * STRAGGLER_SCORE > fastest and s.sections_us.get(n, 0.0)
                             >= floor for s in shares[r])
            if len(med) > 1 and score < STRAGGLER_SCORE and m[n] >= floor \
                    and slow_steps >= STRAGGLER_STEPS * len(shares[r]):
                out["stragglers"].append({"rank": r, "section": n, "score": round(score, 3),
                                          "median_ms": round(m[n] / 1e3, 3), "fastest_ms": round(fastest / 1e3, 3),
                                          "slow_steps": slow_steps, "steps": len(shares[r])})
    busy = {r: sum(m.values()) for r, m in med.items()}
    slow = max(busy, key=lambda r: busy[r]) if busy else None
    if slow is not None and names:
        sec = min(names, key=lambda n: out["scores"][str(slow)][n])
        out["slowest"] = {"rank": slow, "section": sec, "score": out["scores"][str(slow)][sec],
                          "busy_ms": round(busy[slow] / 1e3, 3)}
    out["stragglers"].sort(key=lambda s: s["score"])
    return out


def _metrics_window(run_dir: Path | None, steps: list[int]) -> dict:
    """metrics.jsonl's own data share for the window's steps (rank 0's clock), a cross-check."""
    p = Path(run_dir) / rundir.METRICS if run_dir else None
    if p is None or not p.exists():
        return {}
    recs = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    recs = [r for r in recs if r.get("kind") == "step" and r.get("step") in steps and r.get("step_time_s")]
    if not recs:
        return {}
    return {"steps": [r["step"] for r in recs],
            "data_pct": round(100 * _med(r["data_time_s"] / r["step_time_s"] for r in recs), 2),
            "step_ms": round(1e3 * _med(r["step_time_s"] for r in recs), 3)}


def analyze(traces: list[RankTrace], spec: dict | None = None, run_dir: Path | None = None,
            calibration: str | None = None) -> dict:
    common = sorted(set.intersection(*(set(t.steps) for t in traces))) if traces else []
    traces = [replace(t, steps={k: v for k, v in t.steps.items() if k in common}) for t in traces]
    clock = estimate(traces)
    late = lateness(traces, clock)
    fr = fr_lateness(traces, clock)
    # the window's steps on the aligned clock, widest over ranks: a collective belongs to the step it starts in
    bounds = [(min(t.steps[n][0] - clock.offsets_us[t.rank] for t in traces),
               max(t.steps[n][1] - clock.offsets_us[t.rank] for t in traces)) for n in common]
    shares = {t.rank: rank_shares(t) for t in traces}
    report = {
        "schema": SCHEMA,
        "run_dir": str(run_dir) if run_dir else None,
        "world": len(traces),
        "steps": common,
        "clock": clock.to_dict(),
        "ranks": [_rank_summary(t, shares[t.rank], late[t.rank], clock, fr[t.rank] if fr else None, bounds)
                  for t in traces],
        "sections": section_scores(shares),
        "metrics": _metrics_window(run_dir, common),
        "device": {"device": traces[0].meta.get("device") if traces else None,
                   "name": traces[0].meta.get("device_name") if traces else None},
        "spec": {k: (spec or {}).get(s, {}).get(k) for s, k in
                 (("parallel", "strategy"), ("parallel", "bucket_cap_mb"), ("data", "num_workers"),
                  ("schedule", "micro_batch"), ("parallel", "comm_hook"))} if spec else {},
    }
    if spec:
        report["memory_vs_plan"] = against_plan.compare(report, spec)
        report["efficiency"] = efficiency.measure(report, spec, calibration, report["device"])
        report["what_if"] = whatif.table(report, spec)
    plan_p = Path(run_dir) / rundir.FROM_PLAN if run_dir else None
    if plan_p is not None and plan_p.is_file():   # `tandem train --plan`: the plan the run was started from
        report["vs_from_plan"] = against_plan.from_plan(report, json.loads(plan_p.read_text()), spec)
    report["verdicts"] = (judge(report) + against_plan.memory_verdicts(report, spec)
                          + efficiency.verdicts(report, spec))
    if spec:
        proposed = [(" ".join(f"{k} {v:g}" for k, v in x["setting"].items()), x["setting"])
                    for x in report["verdicts"] if x.get("setting")]
        report["step_time"] = steptime.table(report, spec, traces, whatif.alternatives(spec) + proposed, calibration)
    whatif.annotate(report["verdicts"], spec, report)
    steptime.annotate(report["verdicts"], report)
    weigh(report["verdicts"], report.get("step_time"))  # no change the model predicts slower
    return report
