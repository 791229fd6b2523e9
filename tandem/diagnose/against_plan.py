"""The run against `tandem plan`'s prediction for the same spec: memory by category, and what-ifs.

The planner reads the run's own ``spec.json`` (``tandem plan --config`` does the same), so its
numbers are for the model, batch, strategy and precision the run used. Memory is compared per
category with MemTracker's peak (the step after the profiler window):

    Parameter  <-> params (+ the blocks FSDP gathers, under zero3: the plan's "other" minus the context)
    Gradient   <-> grads  (+ DDP's bucket bytes when gradients are views of the buckets: MemTracker
                           sees no gradient tensor then, the buckets were allocated before tracking)
    Optstate   <-> optimizer
    Activation <-> activations (Korthikanti et al.'s per-layer terms + fp32 logits, or a CNN's measured ones)

tandem trains bf16/fp16 under autocast: weights, gradients and Adam's moments stay fp32 (no separate
master copy), so the model states and the gradient traffic are planned at fp32; activations at the
run's precision.
The CUDA context and allocator slack (the plan's 1 GiB "other") are not tensors MemTracker sees.

What-ifs re-plan the same spec with one setting changed (``parallel.strategy zero3``,
``parallel.activation_checkpoint full``, ``precision.dtype bf16``) and apply the planner's change in
each category to the measured peak: the measured figure carries what the plan leaves out.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile

MIB = float(1 << 20)
CATS = ("params", "grads", "optimizer", "activations")
MEASURED = {"params": "Parameter", "grads": "Gradient", "optimizer": "Optstate", "activations": "Activation"}
OVER_PLAN = 1.10             # measured peak / plan above this: the memory verdict (issue 12's rule) ...
OVER_PLAN_MIN = 64 * MIB     # ... when the excess is also this large: a toy model's per-op buffers change nothing
NEAR_CAPACITY = 0.90         # measured peak / the device's memory (or the host's share of RAM) above this


def plan_inputs(spec: dict, changes: dict | None = None, bucket_floor: float = 0.0, **plan_args):
    """The planner's (model, cluster, training, strategy) for ``spec`` with ``changes`` ({"section.key":
    value}) applied, the DDP bucket at the spec's bucket_cap_mb (at least ``bucket_floor`` bytes).
    ``plan_args``: PlanArgs's own (calibration, compute_time, overlap)."""
    from tandem.plan.inputs.args import PlanArgs, resolve, strategy

    d = copy.deepcopy(spec)
    for k, v in (changes or {}).items():
        sec, key = k.split(".", 1)
        d.setdefault(sec, {})[key] = v
    fd, path = tempfile.mkstemp(suffix=".json", prefix="tandem-diag-plan-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(d, f)
        shape = None
        if ":" in str((d.get("model") or {}).get("name", "")):  # a user's factory: measured on the spec's image
            size = d["data"].get("image_size", 224)                # shape (tandem's image data)
            shape = f"{d['model'].get('in_channels', 3)},{size},{size}"
        with _model_cache():
            m, c, t, v = resolve(PlanArgs(config=path, input_shape=shape, **plan_args))
    finally:
        os.unlink(path)
    s = strategy(v, c, t)
    t.bucket_bytes = max(float(d.get("parallel", {}).get("bucket_cap_mb") or 25.0) * MIB, bucket_floor)
    return m, c, t, s


def planned(spec: dict, changes: dict | None = None) -> dict:
    """The planner's memory per rank (bytes by category) and gradient bytes per step for ``spec`` with
    ``changes`` ({"section.key": value}) applied. {"error": ...} when the planner cannot place the model."""
    from tandem.plan.cost import evaluate
    from tandem.plan.terms.memory import CONTEXT_BYTES, memory
    from tandem.plan.terms.params import shard_group

    try:
        m, c, t, s = plan_inputs(spec, changes)
        p = evaluate(m, c, t, s)
        states_t = copy.copy(t)
        if t.precision in ("bf16", "fp16"):  # autocast: fp32 weights, grads and moments, no master copy
            states_t.precision = "fp32"
        st = memory(m, c, states_t, s, p.grad_accum)
        p_states = evaluate(m, c, states_t, s) if states_t is not t else p   # fp32 gradients on the wire
    except Exception as e:  # noqa: BLE001 - a model the planner cannot size: say so, diagnose goes on
        return {"error": f"{type(e).__name__}: {e}"}
    mem = p.memory
    # FSDP gathers a block and prefetches the next (the plan's "other"); never more than the rest of the model
    gathered = (min(max(0.0, mem.other - CONTEXT_BYTES), st.params * (shard_group(s, c) - 1))
                if s.zero >= 3 and s.dp > 1 else 0.0)
    grad_ops = [o for o in p_states.comm if o.name in ("dp-grad", "hsdp-replicas")]
    param_ops = [o for o in p_states.comm if o.name in ("dp-params", "fsdp-params")]

    def wire(o) -> float:  # ring traffic a rank sends: all-reduce 2(n-1)/n of its bytes, RS/AG (n-1)/n
        n = o.group.size
        return (2.0 if o.collective == "all_reduce" else 1.0) * (n - 1) / n * o.bytes * o.calls if n > 1 else 0.0

    return {"strategy": s.label(), "precision": t.precision, "model": m.name,
            "bytes": {"params": st.params, "grads": st.grads, "optimizer": st.optimizer,
                      "activations": mem.activations, "gathered": gathered},
            "grad_bytes_per_step": sum(o.bytes * o.calls for o in grad_ops),
            "grad_calls_per_step": sum(o.chunks * o.calls for o in grad_ops),
            "param_calls_per_step": sum(o.chunks * o.calls for o in param_ops),
            "dp_wire_bytes": sum(wire(o) for o in grad_ops + param_ops)}


_MODELS: dict[str, object] = {}


@contextlib.contextmanager
def _model_cache():
    """The what-ifs change strategy, precision and checkpointing, never the model: measure a model (a
    ResNet or a user's factory on the meta device, ~1-2 s each) once per diagnose, not once per what-if."""
    from tandem.plan.inputs import args as inputs

    orig = inputs.resolve_model

    def cached(v: dict, spec: dict):
        key = repr(([v.get(k) for k in ("model", "params", "layers", "hidden", "heads", "kv_heads", "ffn", "seq",
                                        "vocab", "gated", "input_shape")],
                    [spec.get(k) for k in ("_spec_model", "_image", "_tied")]))
        if key not in _MODELS:
            _MODELS[key] = orig(v, spec)
        return copy.deepcopy(_MODELS[key])

    inputs.resolve_model = cached
    try:
        yield
    finally:
        inputs.resolve_model = orig


def compare(rep: dict, spec: dict) -> dict | None:
    """Measured peak vs plan per rank and category (MiB), with the notes that explain a gap."""
    mems = [(r["rank"], r.get("memory"), r) for r in rep["ranks"]]
    mems = [(k, m, r) for k, m, r in mems if m and "peak_mib" in m]
    if not mems:
        return None
    plan = planned(spec)
    if "error" in plan:
        return {"error": plan["error"]}
    par = spec.get("parallel") or {}
    strategy = par.get("strategy", "ddp")
    pb = plan["bytes"]
    want = {"params": pb["params"] + pb["gathered"], "grads": pb["grads"], "optimizer": pb["optimizer"],
            "activations": pb["activations"]}
    notes = []
    if pb["gathered"]:
        notes.append(f"zero3: at the peak FSDP holds gathered blocks; the plan's params column adds them "
                     f"({pb['params'] / MIB:.3g} MiB shard + {pb['gathered'] / MIB:.3g} MiB gathered)")
    if strategy in ("zero2", "zero3", "fsdp", "hsdp"):
        notes.append(f"{strategy}: MemTracker's peak comes in the backward, before most sharded gradients exist "
                     "(FSDP writes each block's after its reduce-scatter; zero_grad frees them every step): "
                     "Gradient below the plan is expected")
    ranks = {}
    for k, m, r in mems:
        got = {c: m["peak_mib"].get(MEASURED[c], 0.0) * MIB for c in CATS}
        bucket = r["collectives"]["grad_bytes_per_step"]
        if strategy == "ddp" and par.get("gradient_as_bucket_view", True) and got["grads"] == 0 and bucket:
            got["grads"] = float(bucket)  # the buckets hold the gradients; allocated before tracking
            if not any("DDP's buckets" in n for n in notes):
                notes.append("ddp: gradients are views of DDP's buckets (gradient_as_bucket_view), allocated "
                             "before the tracked step: the bucket bytes from the trace stand in for them")
        other = sum(v for c, v in m["peak_mib"].items() if c not in MEASURED.values() and c != "Total") * MIB
        total = sum(got.values()) + other
        ranks[str(k)] = {"measured_mib": {c: round(got[c] / MIB, 4) for c in CATS},
                         "other_mib": round(other / MIB, 4), "total_mib": round(total / MIB, 4),
                         "ratio": {c: (round(got[c] / want[c], 3) if want[c] else None) for c in CATS},
                         "total_ratio": round(total / sum(want.values()), 3) if sum(want.values()) else None,
                         "capacity_mib": (round(m["capacity_bytes"] / MIB, 1) if m.get("capacity_bytes") else None)}
    worst = max(ranks.values(), key=lambda x: x["ratio"]["activations"] or 0)["ratio"]["activations"]
    if worst and worst > OVER_PLAN:
        notes.append(f"activations: the plan counts each layer's saved tensors (Korthikanti et al. 2022) and the "
                     f"fp32 logits; up to {worst:.2f}x that is measured: what this model also keeps (embeddings' "
                     "output, its attention kernel's and the loss's buffers) is not in the formula")
    return {"plan": {"strategy": plan["strategy"], "precision": plan["precision"],
                     "mib": {c: round(want[c] / MIB, 4) for c in CATS},
                     "total_mib": round(sum(want.values()) / MIB, 4)},
            "ranks": ranks, "notes": notes}


def _fmt(mib: float) -> str:
    return f"{mib:.3g} MiB" if mib < 1024 else f"{mib / 1024:.3g} GiB"


def what_if(spec: dict, changes: dict, base: dict, measured: dict[str, float]) -> dict | None:
    """The planner's change per category for ``changes``, applied to the measured bytes (MiB)."""
    alt = planned(spec, changes)
    if "error" in alt or "error" in base:
        return None
    delta = {c: (alt["bytes"][c] + (alt["bytes"]["gathered"] if c == "params" else 0)
                 - base["bytes"][c] - (base["bytes"]["gathered"] if c == "params" else 0)) / MIB for c in CATS}
    after = {c: max(0.0, measured[c] + delta[c]) for c in CATS}
    return {"changes": changes, "delta_mib": {c: round(delta[c], 4) for c in CATS},
            "after_mib": {c: round(after[c], 4) for c in CATS}, "strategy": alt["strategy"]}


def memory_verdicts(rep: dict, spec: dict | None) -> list[dict]:
    """Peak memory near the device's capacity, or well over the plan: what to change, with the planner's
    what-if for each proposal applied to the measured peak."""
    vs = rep.get("memory_vs_plan") or {}
    if not spec or not vs.get("ranks"):
        return []
    worst_k, worst = max(vs["ranks"].items(), key=lambda kv: kv[1]["total_mib"])
    total, cap, plan_total = worst["total_mib"], worst.get("capacity_mib"), vs["plan"]["total_mib"]
    near = bool(cap) and total >= NEAR_CAPACITY * cap
    over = total >= OVER_PLAN * plan_total and (total - plan_total) * MIB >= OVER_PLAN_MIN
    if not (near or over):
        return []
    ev = [f"rank {worst_k}: peak {_fmt(total)} (MemTracker: " + ", ".join(
        f"{c} {worst['measured_mib'][c]:.3g}" for c in CATS) + f", other {worst['other_mib']:.3g} MiB)"]
    if cap:
        ev.append(f"{100 * total / cap:.0f}% of the {_fmt(cap)} this rank has")
    ev.append(f"plan for the same spec ({vs['plan']['strategy']}): {_fmt(plan_total)} "
              f"({worst['total_ratio']:.2f}x measured/plan)")
    ev += vs.get("notes", [])
    base = planned(spec)
    par, prec = spec.get("parallel") or {}, (spec.get("precision") or {}).get("dtype", "fp32")
    got = {c: worst["measured_mib"][c] for c in CATS}
    states = got["params"] + got["grads"] + got["optimizer"]
    options = []
    if par.get("activation_checkpoint", "none") != "full":
        options.append(("parallel.activation_checkpoint full", {"parallel.activation_checkpoint": "full"}))
    if prec == "fp32":
        options.append(("precision.dtype bf16", {"precision.dtype": "bf16"}))
    if par.get("strategy", "ddp") in ("ddp", "zero1", "zero2") and int(par.get("pp", 1)) == 1:
        options.append(("parallel.strategy zero3", {"parallel.strategy": "zero3"}))
    if got["activations"] < states:   # the bigger category first
        options.reverse()
    lines = []
    for label, ch in options:
        w = what_if(spec, ch, base, got)
        if w is None:
            continue
        after = sum(w["after_mib"].values()) + worst["other_mib"]
        lines.append(f"{label}: peak {_fmt(total)} -> ~{_fmt(after)} (planner: " + ", ".join(
            f"{c} {w['delta_mib'][c]:+.3g} MiB" for c in CATS if abs(w["delta_mib"][c]) > 1e-6) + ")")
        ev.append(f"what-if {lines[-1]}")
    title = ("memory near capacity" if near else "memory over plan") + f": {_fmt(total)} on rank {worst_k}"
    change = ("; ".join(lines) if lines else "a smaller schedule.micro_batch (with more accumulation)") + \
        " (the planner's change per category, applied to the measured peak)"
    return [{"kind": "memory", "ranks": [int(worst_k)], "title": title, "evidence": ev, "change": change}]


def render(rep: dict, console) -> None:
    vs = rep.get("memory_vs_plan")
    if not vs:
        return
    if "error" in vs:
        console.print(f"  plan: no memory prediction for this model ({vs['error'][:120]})", highlight=False)
        return
    p = vs["plan"]
    console.print(f"Peak memory against the plan ({p['strategy']}, {p['precision']}), MiB measured / planned:",
                  highlight=False)
    for r, x in vs["ranks"].items():
        cells = ", ".join(f"{c} {x['measured_mib'][c]:.3g}/{p['mib'][c]:.3g}"
                          + (f" ({x['ratio'][c]:.2f}x)" if x["ratio"][c] is not None else "") for c in CATS)
        console.print(f"  rank {r}: {cells}; total {x['total_mib']:.3g}/{p['total_mib']:.3g} "
                      f"({x['total_ratio']:.2f}x, other {x['other_mib']:.3g} MiB unplanned)", highlight=False)
    for n in vs.get("notes", []):
        console.print(f"  note: {n}", highlight=False)


SHARES = (("compute", "compute_s"), ("comm", "exposed_comm_s"), ("idle", "bubble_s"), ("data", None))


def from_plan(rep: dict, doc: dict, spec: dict | None) -> dict:
    """The run against the plan it was started from (RUN_DIR/from_plan.json, `tandem train --plan`): that
    plan's memory per GPU by category and its step shares (compute, exposed communication, bubble) next to
    the measured peak per rank (MemTracker) and the measured step shares (each rank's median). The plan was
    made for its own cluster: its shares compare with the run's, its milliseconds with a run on that cluster."""
    mem, tm, st = doc["memory_per_gpu"], doc["time"], doc["strategy"]
    step = tm["step_s"] or 1.0
    plan = {"strategy": _label(st), "gpu": doc["cluster"]["gpu"], "precision": st["precision"],
            "step_ms": round(tm["step_s"] * 1e3, 4),
            "mib": {c: round(mem[c] / MIB, 4) for c in CATS},
            "shares_pct": {k: round(100 * tm[key] / step, 2) if key else 0.0 for k, key in SHARES}}
    vs = rep.get("memory_vs_plan") or {}
    ranks = {}
    for r in rep["ranks"]:
        k = str(r["rank"])
        m = r.get("memory") or {}
        if k in (vs.get("ranks") or {}):       # the peak as compare() reads it (DDP's buckets as gradients)
            got = vs["ranks"][k]["measured_mib"]
        elif "peak_mib" in m:
            got = {c: round(m["peak_mib"].get(MEASURED[c], 0.0), 4) for c in CATS}
        else:
            got = None
        med = r["median"]
        ranks[k] = {"measured_mib": got,
                    "ratio": ({c: (round(got[c] / plan["mib"][c], 3) if plan["mib"][c] else None) for c in CATS}
                              if got else None),
                    "shares_pct": {s: med.get(f"{s}_pct") for s, _ in SHARES}, "step_ms": med.get("step_ms")}
    notes = []
    if spec:   # the layout the run has against what the plan applied (a command-line override wins over it)
        drift = [f"{k} {_at(spec, k)} (plan: {v})" for k, v in (doc.get("applied") or {}).items()
                 if str(_at(spec, k)) != str(v)]
        if drift:   # e.g. the run dir resumed later without --plan, with another layout
            notes.append("the run's spec.json is not the plan's layout: " + ", ".join(drift))
        kept = doc.get("kept_from_command_line") or {}
        if kept:
            notes.append("the command line kept " + ", ".join(f"{k} {v}" for k, v in kept.items())
                         + " over the plan's: the run is not exactly the plan's layout")
    if st["zero"] >= 3 and st["dp"] > 1:
        notes.append(f"zero 3: the plan's params are the {st['dp']}-way shard; the blocks FSDP gathers at the peak are "
                     "in its 'other' (the memory comparison above adds them)")
    dev = (rep.get("device") or {}).get("device")
    if dev != "cuda" and doc["cluster"]["gpu"] != "cpu":
        notes.append(f"the plan timed {doc['cluster']['gpu']} GPUs, this run ran on {dev}: its bytes compare, its "
                     f"shares and milliseconds (step {plan['step_ms']:.3g} ms) are that cluster's; a plan made with "
                     "--calibration (tandem bench train) times this machine's")
    if st["precision"] != ((spec or {}).get("precision") or {}).get("dtype", st["precision"]):
        notes.append(f"the plan's precision is {st['precision']}, the run's {spec['precision']['dtype']}: its bytes "
                     "per category differ by that")
    return {"source": doc.get("source"), "plan": plan, "ranks": ranks, "notes": notes}


def _at(spec: dict, key: str):
    sec, name = key.split(".", 1)
    return (spec.get(sec) or {}).get(name)


def _label(st: dict) -> str:
    from tandem.plan.artifact import label   # the planner's name of a layout, as `tandem train --plan` printed it

    return label(st)


def render_from_plan(rep: dict, console) -> None:
    fp = rep.get("vs_from_plan")
    if not fp:
        return
    p = fp["plan"]
    console.print(f"Against the plan this run was started from ({fp.get('source')}: {p['strategy']} on "
                  f"{p['gpu']}, {p['precision']}):", highlight=False)
    for k, x in fp["ranks"].items():
        if x["measured_mib"]:
            cells = ", ".join(f"{c} {x['measured_mib'][c]:.3g}/{p['mib'][c]:.3g}"
                              + (f" ({x['ratio'][c]:.2f}x)" if x["ratio"][c] is not None else "") for c in CATS)
            console.print(f"  rank {k} memory, MiB measured / planned: {cells}", highlight=False)
        sh = ", ".join(f"{s} {x['shares_pct'][s] or 0:.1f}/{p['shares_pct'][s]:.1f}" for s, _ in SHARES)
        console.print(f"  rank {k} step shares, % measured / planned: {sh} (idle against the pipeline bubble)",
                      highlight=False)
    for n in fp["notes"]:
        console.print(f"  note: {n}", highlight=False)
