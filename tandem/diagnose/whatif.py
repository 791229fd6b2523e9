"""What-ifs: the planner on the run's own spec with one setting changed, next to what the run measured.

Per alternative (zero1/2/3, full activation checkpointing, bf16 autocast, DDP's bf16 compression
hook, and the bucket size a verdict proposes): the peak memory a rank would have (the measured peak
plus the planner's change per category, against_plan.what_if), the bytes a rank sends for data
parallelism per step and in how many calls (the planner's collectives, ring traffic: an all-reduce
sends 2(n-1)/n of its bytes, a reduce-scatter or all-gather (n-1)/n), and, for the ones that change
those bytes, the run's measured communication time scaled by them ("if time follows bytes": true
of a bandwidth-bound run, not of a latency-bound one, which is why the calls are printed too).
"""

from __future__ import annotations

from statistics import median

from tandem.diagnose.against_plan import CATS, MIB, planned, what_if

# DDP's bf16 hook casts fp32 gradients to bf16 for the all-reduce (torch's bf16_compress_hook)
HOOK_BYTES = {"bf16": 0.5, "fp16": 0.5}


def _wire(plan: dict) -> float:
    return plan.get("dp_wire_bytes", 0.0)


def alternatives(spec: dict) -> list[tuple[str, dict]]:
    par, prec = spec.get("parallel") or {}, (spec.get("precision") or {}).get("dtype", "fp32")
    strat, pp = par.get("strategy", "ddp"), int(par.get("pp", 1) or 1)
    out = []
    if pp == 1:
        out += [(f"parallel.strategy {z}", {"parallel.strategy": z}) for z in ("zero1", "zero2", "zero3")
                if z != strat and not (strat in ("fsdp", "hsdp") and z == "zero3")]
    if par.get("activation_checkpoint", "none") != "full":
        out.append(("parallel.activation_checkpoint full", {"parallel.activation_checkpoint": "full"}))
    if prec == "fp32":
        out.append(("precision.dtype bf16", {"precision.dtype": "bf16"}))
    if strat == "ddp" and par.get("comm_hook", "none") == "none":
        out.append(("parallel.comm_hook bf16", {"parallel.comm_hook": "bf16"}))
    return out


def _measured(rep: dict) -> tuple[dict[str, float] | None, float, float]:
    """The largest rank's measured peak by category (MiB), its unplanned rest, and the median
    communication time a step over ranks (ms)."""
    vs = rep.get("memory_vs_plan") or {}
    comm = median([r["median"].get("comm_pct", 0) * r["median"].get("step_ms", 0) / 100 for r in rep["ranks"]]
                  or [0.0])
    if not vs.get("ranks"):
        return None, 0.0, comm
    worst = max(vs["ranks"].values(), key=lambda x: x["total_mib"])
    return dict(worst["measured_mib"]), worst["other_mib"], comm


def table(rep: dict, spec: dict | None) -> dict | None:
    if not spec:
        return None
    base = planned(spec)
    if "error" in base:
        return {"error": base["error"]}
    got, other, comm_ms = _measured(rep)
    rows = []
    for label, ch in alternatives(spec):
        hook = ch.get("parallel.comm_hook")
        alt = base if hook else planned(spec, ch)
        if "error" in alt:
            continue
        wire = _wire(base) * HOOK_BYTES[hook] if hook else _wire(alt)
        row = {"setting": label, "changes": ch, "strategy": alt["strategy"], "dp_wire_mib": round(wire / MIB, 4),
               "dp_calls": alt["grad_calls_per_step"] + alt.get("param_calls_per_step", 0)}
        if _wire(base) > 0 and abs(wire / _wire(base) - 1) > 1e-9:
            row["exposed_comm_ms_if_bytes"] = round(comm_ms * wire / _wire(base), 3)
        if got is not None and not hook:
            w = what_if(spec, ch, base, got)
            if w:
                row["peak_mib"] = round(sum(w["after_mib"].values()) + other, 4)
        rows.append(row)
    now = {"strategy": base["strategy"], "dp_wire_mib": round(_wire(base) / MIB, 4),
           "dp_calls": base["grad_calls_per_step"] + base.get("param_calls_per_step", 0),
           "exposed_comm_ms": round(comm_ms, 3)}
    if got is not None:
        now["peak_mib"] = round(sum(got[c] for c in CATS) + other, 4)
    return {"now": now, "rows": rows}


def annotate(verdicts: list[dict], spec: dict | None, rep: dict) -> None:
    """Add the planner's what-if to each verdict that proposes a setting ("setting" key, or the
    alternatives the bandwidth verdict names)."""
    if not spec:
        return
    wi = rep.get("what_if") or {}
    by = {r["setting"]: r for r in wi.get("rows", [])}
    now = wi.get("now") or {}
    measured = [r["collectives"].get("grad_allreduce_per_step") for r in rep.get("ranks", [])]
    measured = [x for x in measured if x]
    for v in verdicts:
        if v.get("setting"):
            key, val = next(iter(v["setting"].items()))
            alt = planned(spec, v["setting"])
            if "error" not in alt and now:
                v["evidence"].append(
                    f"what-if (planner, this spec): {key} {val:g} -> {alt['grad_calls_per_step']:g} gradient "
                    f"call(s) a step of ~{alt['grad_bytes_per_step'] / max(1, alt['grad_calls_per_step']) / MIB:.3g} "
                    f"MiB (now {now['dp_calls']:g}" + (f" planned, {min(measured):g} measured: DDP puts whole "
                                                      "parameters in a bucket)" if measured and
                                                      min(measured) != now["dp_calls"] else ")"))
        elif v["kind"] == "bandwidth-bound":
            for label in ("parallel.comm_hook bf16", "parallel.strategy zero2"):
                r = by.get(label)
                if r:
                    t = (f", exposed communication ~{r['exposed_comm_ms_if_bytes']:.3g} ms a step instead of "
                         f"{now['exposed_comm_ms']:.3g} if time follows bytes" if "exposed_comm_ms_if_bytes" in r else
                         ", the same bytes")
                    v["evidence"].append(f"what-if (planner, this spec): {label} -> {r['dp_wire_mib']:.3g} MiB sent "
                                         f"a rank a step (now {now['dp_wire_mib']:.3g}){t}")


def render(rep: dict, console) -> None:
    wi = rep.get("what_if")
    if not wi or "error" in wi or not wi.get("rows"):
        return
    from rich.table import Table

    now = wi["now"]
    t = Table(title=f"What-ifs: the planner on this run's spec (now {now['strategy']}: peak "
                    f"{now.get('peak_mib', float('nan')):.3g} MiB, {now['dp_wire_mib']:.3g} MiB sent a rank a step in "
                    f"{now['dp_calls']:g} call(s), exposed comm {now['exposed_comm_ms']:.3g} ms)", title_justify="left")
    for col in ("setting", "peak MiB", "sent MiB/step", "calls/step", "exposed comm ms if time follows bytes"):
        t.add_column(col, justify="left" if col == "setting" else "right")
    for r in wi["rows"]:
        t.add_row(r["setting"], f"{r['peak_mib']:.3g}" if "peak_mib" in r else "-", f"{r['dp_wire_mib']:.3g}",
                  f"{r['dp_calls']:g}", f"{r['exposed_comm_ms_if_bytes']:.3g}" if "exposed_comm_ms_if_bytes" in r
                  else "same")
    console.print(t)
