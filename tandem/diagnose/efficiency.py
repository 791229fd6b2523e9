"""Compute efficiency: the FLOP/s each rank reached in the window against what the planner expects.

Measured per rank: the planner's model FLOPs of the rank's samples per step / the rank's busy time
per step (data + compute shares, median over the window: a calibration's rate is a whole step of one
worker, loading included, with no communication). Expected: the planner's rate per worker for the
run's spec with a calibration (``tandem diagnose --calibration FILE``): this model measured on one
worker by `tandem bench train`, slowed by workers sharing the host's cores, or the calibration's
achieved GEMM FLOP/s x the planner's default efficiency. Without a calibration, on a GPU the planner's
preset names (tandem/plan/inputs/hardware.py: the device name torch reports mapped as `tandem plan` maps a
calibration's) give the datasheet peak for the run's precision x the planner's default efficiency for
the model kind; the evidence names that source. A CPU has no datasheet preset: the measured rate is
reported with the reason, and no verdict is made (a guessed CPU peak would be an invented number).

    low-efficiency   measured < LOW x expected on a rank (median over the window)
"""

from __future__ import annotations


LOW = 0.5


def datasheet_gpu(device: dict | None):
    """The planner's preset for the run's device ({"device": "cuda:0", "name": "NVIDIA H200"}), and why
    there is none: (GPU or None, reason)."""
    from tandem.plan.inputs.calibration import match_gpu

    dev = device or {}
    kind, name = str(dev.get("device") or "cpu"), dev.get("name")
    if not kind.startswith("cuda"):
        return None, ("on CPU there is no datasheet peak to compare with (the planner's presets in "
                      "tandem/plan/inputs/hardware.py are GPUs)")
    if not name:
        return None, "the profiler window does not name its GPU (a window.json from before device_name)"
    preset = match_gpu(str(name))
    return (preset, "") if preset else (None, f"no planner preset matches the GPU '{name}' "
                                              "(tandem/plan/inputs/hardware.py)")


def expected(spec: dict, calibration: str | None, gpu: str | None = None) -> dict:
    """The planner's FLOPs per sample for the spec's model and, with a calibration or a GPU preset
    (``gpu``, used only without a calibration), its FLOP/s per worker."""
    from tandem.diagnose.against_plan import plan_inputs
    from tandem.plan.cost import evaluate

    try:
        m, c, t, s = plan_inputs(spec, calibration=calibration, gpu=None if calibration else gpu)
        p = evaluate(m, c, t, s)
    except Exception as e:  # noqa: BLE001 - no FLOP count for this model: say so
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"flops_per_sample": m.flops_per_sample, "samples_per_rank_step": t.global_batch / s.world,
           "model": m.name, "precision": t.precision}
    if calibration:
        out.update(rate=p.rate, source=("this model measured on one worker (bench train), "
                                        f"/ {p.host_factors[0]:.2f} core sharing / {p.host_factors[1]:.2f} "
                                        "waiting for the slowest rank") if p.host_factors else
                   f"the calibration's {t.precision} FLOP/s x efficiency {p.efficiency:.2f}")
    elif gpu:
        out.update(rate=p.rate, peak_flops=c.gpu.peak(t.precision),
                   source=f"{c.gpu.name} datasheet {t.precision} peak {c.gpu.peak(t.precision) / 1e12:.4g} "
                          f"TFLOP/s ({c.gpu.source}) x the planner's efficiency {p.efficiency:.2f} for a "
                          f"{m.kind} model")
    return out


def measure(rep: dict, spec: dict, calibration: str | None, device: dict | None = None) -> dict | None:
    """``device``: the window's {"device", "name"} (window.json / the trace's deviceProperties)."""
    preset, why = (None, "") if calibration else datasheet_gpu(device)
    exp = expected(spec, calibration, preset.name if preset else None)
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
        out.update(expected_flops=round(exp["rate"], 1), source=exp["source"], calibration=calibration,
                   basis="calibration" if calibration else "datasheet")
        if not calibration:
            out["gpu"], out["peak_flops"] = preset.name, exp["peak_flops"]
        for x in ranks.values():
            # 3 significant digits: against a datasheet a small model's ratio is far below 0.001
            x["ratio"] = float(f"{x['flops'] / exp['rate']:.3g}") if x["flops"] and exp["rate"] else None
    else:
        out["no_expectation"] = why + "; give --calibration FILE (from tandem bench train) for an expectation"
    return out


def _rate(x: float) -> str:
    return f"{x / 1e12:.4g} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.3g} GFLOP/s"


def verdicts(rep: dict, spec: dict | None) -> list[dict]:
    e = rep.get("efficiency") or {}
    if not e.get("expected_flops"):
        return []
    low = [(int(k), x) for k, x in e["ranks"].items() if x.get("ratio") is not None and x["ratio"] < LOW]
    if not low:
        return []
    par, launch = (spec or {}).get("parallel") or {}, (spec or {}).get("launch") or {}
    ev = [f"rank {k}: {x['flops'] / 1e9:.3g} GFLOP/s ({e['flops_per_step'] / 1e9:.3g} GFLOP of {e['model']} a step "
          f"in {x['busy_ms']:.1f} ms of data + compute), {x['ratio']:.2g}x the expected" for k, x in low]
    ev.append(f"expected {_rate(e['expected_flops'])} per worker: {e['source']} "
              + (f"(calibration {e['calibration']})" if e.get("calibration") else
                 "(no calibration: the datasheet, not this machine; tandem bench train measures it)"))
    rq = {r["rank"]: (r.get("main_thread") or {}).get("runqueue_ms_per_step") for r in rep["ranks"]}
    for k, x in low:
        if rq.get(k):
            ev.append(f"rank {k}'s main thread waited {rq[k]:.1f} ms a step for a CPU (run queue) of its "
                      f"{x['busy_ms']:.1f} ms busy")
    threads = launch.get("threads_per_worker") or "cores / workers"
    if e.get("basis") == "datasheet":  # a GPU: idle while the CPU launches, or GEMMs too small to fill it
        idle = {r["rank"]: (r.get("median") or {}).get("idle_pct") for r in rep["ranks"]}
        ev += [f"rank {k}: the GPU idle {idle[k]:.1f}% of the step (launch-bound when high)" for k, _ in low
               if idle.get(k) is not None]
        head = "feed larger GEMMs (a larger schedule.micro_batch), "
    else:
        head = (f"give each worker its own cores (launch.threads_per_worker, now {threads}; no other processes "
                "on them), feed larger GEMMs (a larger schedule.micro_batch), ")
    change = (head
              + ("precision.dtype bf16, " if (spec or {}).get("precision", {}).get("dtype") == "fp32" else "")
              + ("parallel.compile true" if not par.get("compile") else "check the compiled graph for breaks")
              + "; then measure again with tandem bench train"
              + (" (it also replaces the datasheet with this GPU's own rate)" if e.get("basis") == "datasheet" else ""))
    ks = [k for k, _ in low]
    return [{"kind": "low-efficiency", "ranks": ks, "evidence": ev, "change": change,
             "title": f"low compute efficiency on rank {', '.join(map(str, ks))}: "
                      f"{min(x['ratio'] for _, x in low):.2g}x the FLOP/s the planner expects"}]


def render(rep: dict, console) -> None:
    e = rep.get("efficiency")
    if not e or "error" in e:
        return
    cells = ", ".join(f"rank {k} {x['flops'] / 1e9:.3g}" + (f" ({x['ratio']:.2g}x)" if x.get("ratio") else "")
                      for k, x in e["ranks"].items() if x["flops"])
    tail = (f"; expected {e['expected_flops'] / 1e9:.4g} ({e['source']})" if e.get("expected_flops")
            else f"; no expectation: {e.get('no_expectation') or 'no calibration given'}")
    console.print(f"compute: {e['flops_per_step'] / 1e9:.3g} GFLOP a rank a step; GFLOP/s over data + compute: "
                  f"{cells}{tail}", highlight=False)
