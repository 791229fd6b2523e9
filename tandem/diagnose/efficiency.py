"""Compute efficiency: the FLOP/s each rank reached in the window against what the planner expects.

Measured per rank: the planner's model FLOPs of the rank's samples per step / the rank's busy time
per step (data + compute shares, median over the window: a calibration's rate is a whole step of one
worker, loading included, with no communication). Expected: the planner's rate per worker for the
run's spec with a calibration (``tandem diagnose --calibration FILE``): this model measured on one
worker by `tandem bench train`, slowed by workers sharing the host's cores, or the calibration's
achieved GEMM FLOP/s x the planner's default efficiency. Without a calibration the measured rate is
reported and no verdict is made: a datasheet peak says little about a CPU or a toy model.

    low-efficiency   measured < LOW x expected on a rank (median over the window)
"""

from __future__ import annotations

import copy
import json
import os
import tempfile

LOW = 0.5


def expected(spec: dict, calibration: str | None) -> dict:
    """The planner's FLOPs per sample for the spec's model and, with a calibration, its FLOP/s per worker."""
    from tandem.plan.cost import evaluate
    from tandem.plan.inputs import PlanArgs, resolve, strategy

    fd, path = tempfile.mkstemp(suffix=".json", prefix="tandem-diag-eff-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(copy.deepcopy(spec), f)
        m, c, t, v = resolve(PlanArgs(config=path, calibration=calibration))
        s = strategy(v, c, t)
        p = evaluate(m, c, t, s)
    except Exception as e:  # noqa: BLE001 - no FLOP count for this model: say so
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        os.unlink(path)
    out = {"flops_per_sample": m.flops_per_sample, "samples_per_rank_step": t.global_batch / s.world,
           "model": m.name, "precision": t.precision}
    if calibration:
        out.update(rate=p.rate, source=("this model measured on one worker (bench train), "
                                        f"/ {p.host_factors[0]:.2f} core sharing / {p.host_factors[1]:.2f} "
                                        "waiting for the slowest rank") if p.host_factors else
                   f"the calibration's {t.precision} FLOP/s x efficiency {p.efficiency:.2f}")
    return out


def measure(rep: dict, spec: dict, calibration: str | None) -> dict | None:
    exp = expected(spec, calibration)
    if "error" in exp or not exp.get("flops_per_sample"):
        return {"error": exp.get("error", "the planner has no FLOP count for this model")}
    flops = exp["flops_per_sample"] * exp["samples_per_rank_step"]
    ranks = {}
    for r in rep["ranks"]:
        st = r["steps"]
        busy = sorted(s["data_ms"] + s["compute_ms"] for s in st)
        b = busy[len(busy) // 2] / 1e3 if busy else 0.0
        ranks[str(r["rank"])] = {"busy_ms": round(b * 1e3, 3), "flops": round(flops / b, 1) if b > 0 else None}
    out = {"flops_per_step": flops, "model": exp["model"], "precision": exp["precision"], "ranks": ranks}
    if "rate" in exp:
        out.update(expected_flops=round(exp["rate"], 1), source=exp["source"], calibration=calibration)
        for x in ranks.values():
            x["ratio"] = round(x["flops"] / exp["rate"], 3) if x["flops"] and exp["rate"] else None
    return out


def verdicts(rep: dict, spec: dict | None) -> list[dict]:
    e = rep.get("efficiency") or {}
    if not e.get("expected_flops"):
        return []
    low = [(int(k), x) for k, x in e["ranks"].items() if x.get("ratio") is not None and x["ratio"] < LOW]
    if not low:
        return []
    par, launch = (spec or {}).get("parallel") or {}, (spec or {}).get("launch") or {}
    ev = [f"rank {k}: {x['flops'] / 1e9:.3g} GFLOP/s ({e['flops_per_step'] / 1e9:.3g} GFLOP of {e['model']} a step "
          f"in {x['busy_ms']:.1f} ms of data + compute), {x['ratio']:.2f}x the expected" for k, x in low]
    ev.append(f"expected {e['expected_flops'] / 1e9:.3g} GFLOP/s per worker: {e['source']} "
              f"(calibration {e['calibration']})")
    rq = {r["rank"]: (r.get("main_thread") or {}).get("runqueue_ms_per_step") for r in rep["ranks"]}
    for k, x in low:
        if rq.get(k):
            ev.append(f"rank {k}'s main thread waited {rq[k]:.1f} ms a step for a CPU (run queue) of its "
                      f"{x['busy_ms']:.1f} ms busy")
    threads = launch.get("threads_per_worker") or "cores / workers"
    change = (f"give each worker its own cores (launch.threads_per_worker, now {threads}; no other processes "
              "on them), feed larger GEMMs (a larger schedule.micro_batch), "
              + ("precision.dtype bf16, " if (spec or {}).get("precision", {}).get("dtype") == "fp32" else "")
              + ("parallel.compile true" if not par.get("compile") else "check the compiled graph for breaks")
              + "; then measure again with tandem bench train")
    ks = [k for k, _ in low]
    return [{"kind": "low-efficiency", "ranks": ks, "evidence": ev, "change": change,
             "title": f"low compute efficiency on rank {', '.join(map(str, ks))}: "
                      f"{min(x['ratio'] for _, x in low):.2f}x the FLOP/s the planner expects"}]


def render(rep: dict, console) -> None:
    e = rep.get("efficiency")
    if not e or "error" in e:
        return
    cells = ", ".join(f"rank {k} {x['flops'] / 1e9:.3g}" + (f" ({x['ratio']:.2f}x)" if x.get("ratio") else "")
                      for k, x in e["ranks"].items() if x["flops"])
    tail = (f"; expected {e['expected_flops'] / 1e9:.3g} ({e['source']})" if e.get("expected_flops")
            else "; no calibration given (--calibration FILE from tandem bench train): no expectation")
    console.print(f"compute: {e['flops_per_step'] / 1e9:.3g} GFLOP a rank a step; GFLOP/s over data + compute: "
                  f"{cells}{tail}", highlight=False)
