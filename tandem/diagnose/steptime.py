"""Step-time what-ifs: the planner's step for each proposed setting, on rates this run measured.

Without a `tandem bench` calibration the planner has no rates for a CPU run, so diagnose gives it
the run's own, from the profiler window:

- compute: the measured compute time a step (median over ranks), passed as the planner's
  ``compute_time``; an alternative's is that time x the planner's own ratio for it (recompute's
  extra FLOPs, another precision's datasheet rate), planned without a compute time;
- links: a per-call latency (alpha: the median span of the small all-reduces, the step's loss,
  on the rank that waits least) and a bus bandwidth (busbw = the ring's factor x bytes /
  (span - alpha), over the gradient collectives, on the fastest rank), written as a calibration
  (schema tandem.calibration/1, ``links.intra_node``) that the planner reads as it reads bench's;
- data and idle time a step: measured, unchanged by these settings, added to the planner's step.

With ``--calibration FILE`` its links are used instead and the source line says so. The planner
then prices each alternative's collectives (calls, bytes, what overlaps the backward) on those
rates. The "now" row is the same model on the run's own settings, printed next to the measured
step: the distance between the two is how far to trust the others.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from statistics import median

from tandem.diagnose.against_plan import MIB, plan_inputs

FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "_allgather_base": 1.0,
          "_reduce_scatter_base": 1.0, "broadcast": 1.0}
UNSEEN_BPS = 1e12       # spans that show no bytes term: the bandwidth is past what they resolve


def _kind(name: str) -> str:
    return name.split(":", 1)[1] if ":" in name else name


def link_rates(traces, world: int) -> dict | None:
    """alpha (s per call) and busbw (bytes/s) fitted to the window's collective spans, or None.

    Per (collective, size) the span is taken on the rank where it is shortest (median over the
    window): a rank that arrived late did not wait, its span is the transfer. Then a least-squares
    line span = alpha + ring bytes / busbw over those sizes (ring bytes: 2(n-1)/n of an all-reduce's,
    (n-1)/n of a reduce-scatter's or all-gather's)."""
    if world < 2:
        return None
    by: dict[tuple[str, int], dict[int, list[float]]] = {}
    for t in traces:
        lo = min((a for a, _ in t.steps.values()), default=0.0)
        hi = max((b for _, b in t.steps.values()), default=0.0)
        for c in t.comms:
            k = _kind(c.name)
            if lo <= c.start < hi and c.dur > 0 and c.nbytes > 0 and k in FACTOR:
                by.setdefault((k, c.nbytes), {}).setdefault(t.rank, []).append(c.dur / 1e6)
    pts = [(FACTOR[k] * (world - 1) / world * n, min(median(v) for v in ranks.values()), sum(map(len, ranks.values())))
           for (k, n), ranks in by.items()]
    if not pts:
        return None
    xs, ys = [x for x, _, _ in pts], [y for _, y, _ in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    if slope <= 0 or len(pts) < 2:  # one size, or spans that do not grow with bytes: all latency
        return {"alpha_s": min(ys), "busbw_Bps": None, "sizes": len(pts), "spans": sum(n for *_, n in pts),
                "bytes": [min(xs), max(xs)]}
    alpha = max(my - slope * mx, 0.0)
    return {"alpha_s": alpha, "busbw_Bps": 1.0 / slope, "sizes": len(pts), "spans": sum(n for *_, n in pts),
            "bytes": [min(xs), max(xs)]}


def _calibration(rates: dict, traces, world: int, flops: dict) -> dict:
    m = traces[0].meta if traces else {}
    return {"compute": {"achieved_flops": flops},
            "schema": "tandem.calibration/1", "host": "this run's profile", "backend": m.get("backend") or "gloo",
            "device": "cuda" if str(m.get("device", "cpu")).startswith("cuda") else "cpu",
            "world_size": world, "nnodes": 1, "nproc_per_node": world, "hosts": [m.get("host") or "localhost"],
            "links": {"intra_node": {"bandwidth_Bps": rates["busbw_Bps"] or UNSEEN_BPS,
                                     "latency_s": max(rates["alpha_s"], 1e-9),
                                     "group_size": world}}}


def _plan(spec: dict, changes: dict, calibration: str, compute_time: float | None, wire_fp32: bool = True,
          overlap: float | None = None, bucket_floor: float = 0.0):
    """The planner's Plan for ``spec`` + ``changes`` on the calibration's cluster. Under autocast
    tandem keeps fp32 gradients, so the collectives are priced at fp32 unless ``wire_fp32`` is off
    (DDP's bf16 hook: bf16 on the wire)."""
    from tandem.plan.cost import evaluate

    m, c, t, s = plan_inputs(spec, changes, bucket_floor, calibration=calibration, compute_time=compute_time,
                             overlap=overlap)
    if wire_fp32 and t.precision in ("bf16", "fp16") and not t.grad_reduce:
        t = copy.copy(t)
        t.grad_reduce = "fp32"   # the reduction's dtype only: compute stays at the run's precision
    return evaluate(m, c, t, s)


def _cal_alpha(path: str) -> float:
    li = (json.loads(open(path).read()).get("links") or {})
    li = li.get("intra_node") or li.get("inter_node") or {}
    return float(li.get("latency_s") or 0.0)


def _bucket_floor(rep: dict, spec: dict) -> float:
    """DDP puts whole parameters in a bucket, so it makes fewer buckets than bytes / cap when the cap
    is below a parameter's size: the run's mean bucket is then the smallest a bucket gets."""
    if (spec.get("parallel") or {}).get("strategy", "ddp") != "ddp":
        return 0.0
    calls = median(r["collectives"]["grad_allreduce_per_step"] for r in rep["ranks"])
    total = median(r["collectives"]["grad_bytes_per_step"] for r in rep["ranks"])
    cap = float((spec.get("parallel") or {}).get("bucket_cap_mb") or 25.0) * MIB
    return total / calls if calls and total and calls < -(-total // cap) else 0.0


def _flops(rep: dict, meas: dict) -> dict:
    """The run's FLOP/s over its compute time, at its precision: the planner needs a rate for the
    compute it is asked to time without ``compute_time`` (only the ratio between settings is used)."""
    eff = rep.get("efficiency") or {}
    prec = eff.get("precision") or "fp32"
    f = eff.get("flops_per_step")
    return {prec: f / (meas["compute_ms"] / 1e3) if f and meas["compute_ms"] > 0 else 1e9}


def _measured(rep: dict) -> dict:
    med = lambda k: median(r["median"].get(k, 0.0) * r["median"]["step_ms"] / 100 for r in rep["ranks"])  # noqa: E731
    return {"step_ms": max(r["median"]["step_ms"] for r in rep["ranks"]), "data_ms": med("data_pct"),
            "compute_ms": med("compute_pct"), "comm_ms": med("comm_pct"), "idle_ms": med("idle_pct")}


def table(rep: dict, spec: dict | None, traces, settings: list[tuple[str, dict]],
          calibration: str | None = None) -> dict | None:
    """Predicted step per setting: {"source", "now", "rows" [{setting, step_ms, compute_ms, comm_ms,
    exposed_comm_ms}]}, or {"error"}; None without a spec or a second rank."""
    world = rep.get("world") or 0
    if not spec or world < 2:
        return None
    meas = _measured(rep)
    rates = link_rates(traces, world)
    try:
        cal_links = bool(calibration) and bool((json.loads(open(calibration).read()).get("links") or {}))
    except (OSError, ValueError, AttributeError) as e:
        return {"error": f"calibration {calibration}: {type(e).__name__}: {e}"[:300]}
    if not cal_links and rates is None:
        return {"error": "no small all-reduce and large collective in the window to measure the links from"}
    tmp = None
    try:
        if cal_links:
            cal, source = calibration, f"links from the calibration {calibration}"
            alpha = _cal_alpha(calibration)
        else:
            fd, tmp = tempfile.mkstemp(suffix=".json", prefix="tandem-diag-links-")
            with os.fdopen(fd, "w") as f:
                json.dump(_calibration(rates, traces, world, _flops(rep, meas)), f)
            cal, alpha = tmp, rates["alpha_s"]
            bw = (f"{rates['busbw_Bps'] / 1e6:.3g} MB/s bus bandwidth" if rates["busbw_Bps"] else
                  "no bandwidth term (the spans do not grow with their bytes)")
            source = (f"links from this run's profile (no calibration): {rates['alpha_s'] * 1e3:.3g} ms a call, "
                      f"{bw} (span = alpha + bytes / busbw fitted to {rates['spans']} collectives of "
                      f"{rates['sizes']} sizes, {rates['bytes'][0]:.3g}-{rates['bytes'][1]:.3g} ring bytes, each on "
                      "the rank that waited least)")
        comp_s = meas["compute_ms"] / 1e3
        ov = median(r["median"].get("overlap_pct", 0.0) for r in rep["ranks"]) / 100
        floor = _bucket_floor(rep, spec)
        cpu = not str((traces[0].meta if traces else {}).get("device", "cpu")).startswith("cuda")
        base_ref = _plan(spec, {}, cal, None, wire_fp32=False)  # compute at the run's precision
        fixed = meas["data_ms"] + meas["idle_ms"]

        def row(label: str, ch: dict) -> dict:
            hook = ch.get("parallel.comm_hook") in ("bf16", "fp16")
            ratio = 1.0 if hook or base_ref.compute_s <= 0 else \
                _plan(spec, ch, cal, None, wire_fp32=False).compute_s / base_ref.compute_s
            p = _plan(spec, {} if hook else ch, cal, comp_s * ratio, bucket_floor=floor)
            comm, hidden = p.comm_s, p.comm_s - p.exposed_comm_s
            if hook:  # DDP's hook sends bf16 gradients: each call's latency, half its bytes term
                lat = sum(o.chunks * o.calls for o in p.comm if o.time_s > 0) * alpha
                comm = lat + (comm - lat) / 2
                hidden *= comm / p.comm_s if p.comm_s else 0.0
            # on CPU the planner hides nothing (gloo's threads share the cores); the run's own share
            # hidden (HTA's overlap) is kept. On GPUs the planner's overlap model stands.
            exposed = comm * (1 - ov) if cpu else comm - hidden
            step = p.compute_s + p.bubble_s + exposed
            return {"setting": label, "changes": ch, "step_ms": round(step * 1e3 + fixed, 3),
                    "compute_ms": round(p.compute_s * 1e3, 3), "comm_ms": round(comm * 1e3, 3),
                    "exposed_comm_ms": round(exposed * 1e3, 3)}

        now = row("now", {})
        rows = []
        for label, ch in settings:
            try:
                rows.append(row(label, ch))
                rows[-1]["vs_now"] = round(rows[-1]["step_ms"] / now["step_ms"], 3) if now["step_ms"] else None
            except Exception as e:  # noqa: BLE001 - a setting the planner refuses for this spec: say so
                rows.append({"setting": label, "changes": ch, "error": f"{type(e).__name__}: {e}"[:160]})
    except Exception as e:  # noqa: BLE001 - a model or cluster the planner cannot price: diagnose goes on
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        if tmp:
            os.unlink(tmp)
    compute_src = (f"compute {meas['compute_ms']:.3g} ms a step measured (median over ranks), an alternative's "
                   "scaled by the planner's ratio (FLOPs, precision)")
    extra = f"; {100 * ov:.0f}% of the communication hidden, as measured" if cpu else ""
    if floor:
        extra += f"; DDP's buckets at least {floor / MIB:.3g} MiB (the run's mean: whole parameters per bucket)"
    return {"source": f"{compute_src}; {source}; data + idle {fixed:.3g} ms a step as measured{extra}",
            "rates": rates, "measured": {k: round(v, 3) for k, v in meas.items()}, "now": now, "rows": rows}


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"   # None: the model's step for the run is 0


def _line(r: dict, now: dict) -> str:
    return ("step time (planner on this run's rates): "
            f"{r['setting']} -> {r['step_ms']:.3g} ms a step, {_x(r.get('vs_now'))} the model's {now['step_ms']:.3g} "
            f"ms for the run as it is (exposed communication {r['exposed_comm_ms']:.3g} ms, now "
            f"{now['exposed_comm_ms']:.3g})")


def annotate(verdicts: list[dict], rep: dict) -> None:
    """The step-time what-if of each setting a verdict proposes (a bucket size; the bandwidth
    verdict's hook and zero2)."""
    st = rep.get("step_time") or {}
    if not st.get("rows"):
        return
    by = {r["setting"]: r for r in st["rows"] if "step_ms" in r}
    for v in verdicts:
        labels = ([" ".join(f"{k} {x:g}" for k, x in v["setting"].items())] if v.get("setting") else
                  ["parallel.comm_hook bf16", "parallel.strategy zero2"] if v["kind"] == "bandwidth-bound" else [])
        for label in labels:
            if label in by:
                v["evidence"].append(_line(by[label], st["now"]))


def render(rep: dict, console) -> None:
    st = rep.get("step_time")
    if not st:
        return
    if "error" in st:
        console.print(f"step-time what-ifs: none ({st['error']})", highlight=False)
        return
    from rich.table import Table

    now, meas = st["now"], st["measured"]
    t = Table(title=f"Step-time what-ifs (planner, this run's rates): the run as it is {now['step_ms']:.3g} ms a step "
                    f"by the model, {meas['step_ms']:.3g} ms measured (slowest rank)", title_justify="left")
    for col in ("setting", "step ms", "vs now", "compute ms", "comm ms", "exposed comm ms"):
        t.add_column(col, justify="left" if col == "setting" else "right")
    refused = []
    for r in [now] + st["rows"]:
        if "error" in r:
            t.add_row(r["setting"], "-", "-", "-", "-", "-")
            refused.append(f"{r['setting']}: {r['error'].split(': ', 1)[-1]}")
            continue
        t.add_row(r["setting"], f"{r['step_ms']:.3g}", _x(r.get("vs_now", 1.0)), f"{r['compute_ms']:.3g}",
                  f"{r['comm_ms']:.3g}", f"{r['exposed_comm_ms']:.3g}")
    console.print(t)
    for x in refused:
        console.print(f"  the planner refuses {x}", highlight=False)
    console.print(f"  source: {st['source']}", highlight=False)
