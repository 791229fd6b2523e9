"""Outputs of `tandem diagnose`: the terminal report (rich), the merged Chrome/Perfetto trace, and the
per-rank traces on one clock that Holistic Trace Analysis reads."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tandem.diagnose.trace import RankTrace

# Flow arrows link ids inside one file; merged, the ids of different ranks would collide.
_DROP_PH = {"s", "f", "t"}


def merged_trace(traces: list[RankTrace], offsets_us: dict[int, float], out: Path) -> int:
    """One process per rank (pid = rank), every time on rank 0's clock; returns the bytes written."""
    events = []
    for t in traces:
        shift = _shift(t, traces[0], offsets_us)
        events.append({"ph": "M", "name": "process_name", "pid": t.rank, "tid": 0, "args": {"name": f"rank {t.rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": t.rank, "tid": 0,
                       "args": {"sort_index": t.rank}})
        for e in t.raw:
            ph = e.get("ph")
            if ph in _DROP_PH or (ph == "M" and e.get("name", "").startswith("process_")):
                continue
            e2 = dict(e)
            e2["pid"] = t.rank
            if "ts" in e2 and ph != "M":
                e2["ts"] = round(float(e2["ts"]) + shift, 3)
            events.append(e2)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "baseTimeNanoseconds": int(traces[0].base_us * 1000) if traces else 0,
           "otherData": {"producer": "tandem diagnose", "clock_offsets_us": {str(k): v for k, v in offsets_us.items()}}}
    return _write(doc, out)


def _shift(t: RankTrace, t0: RankTrace, offsets_us: dict[int, float]) -> float:
    return (t.base_us - t0.base_us) - offsets_us.get(t.rank, 0.0)


def _write(doc: dict, out: Path, separators=(",", ":")) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    data = json.dumps(doc, separators=separators).encode()  # one write: a gzip stream of small writes is slow
    tmp.write_bytes(gzip.compress(data, compresslevel=3) if out.name.endswith(".gz") else data)
    tmp.replace(out)
    return out.stat().st_size


def hta_traces(traces: list[RankTrace], offsets_us: dict[int, float], out_dir: Path) -> int:
    """One file per rank, as Holistic Trace Analysis reads a job (``TraceAnalysis(trace_dir=out_dir)``):
    each rank's own trace (every event and top-level key torch wrote, flows included: their ids are
    per file) moved onto rank 0's clock and time base, with ``distributedInfo`` naming its rank (HTA
    maps files to ranks by it and refuses a file without one). Returns the bytes written."""
    total = 0
    for t in traces:
        shift = _shift(t, traces[0], offsets_us)
        events = []
        for e in t.raw:
            if "ts" in e and e.get("ph") != "M":
                e = dict(e, ts=round(float(e["ts"]) + shift, 3))
            events.append(e)
        info = dict(t.header.get("distributedInfo") or {})
        info.update(rank=t.rank, world_size=len(traces))
        info.setdefault("backend", t.meta.get("backend"))
        # HTA (0.5.0) finds a file's rank with the regex '"rank":\s+(\d+)', first match in the file:
        # distributedInfo goes first, written with a space after each colon, as torch writes it
        doc = {"distributedInfo": info, **{k: v for k, v in t.header.items() if k != "distributedInfo"},
               "baseTimeNanoseconds": int(traces[0].base_us * 1000), "traceEvents": events}
        doc.setdefault("schemaVersion", 1)
        total += _write(doc, Path(out_dir) / f"rank-{t.rank}.json.gz", separators=(",", ": "))
    return total


def render(rep: dict, console: Console) -> None:
    c = rep["clock"]
    steps = rep["steps"]
    console.print(f"[bold]tandem diagnose[/] {rep.get('run_dir') or ''}: {rep['world']} rank(s), "
                  f"steps {steps[0]}-{steps[-1]}" if steps else "no common steps", highlight=False)
    if rep["world"] > 1:
        one = c["method"] == "one-host"
        offs = ", ".join(f"rank {r} {float(v) / 1e3:+.3f} ms" for r, v in
                         (c["estimated_offsets_us"] if one else c["offsets_us"]).items() if r != "0")
        how = (f"one host, one clock (the {c['matched_collectives']} matched collectives estimate {offs})" if one
               else f"aligned by {c['method']} ({c['matched_collectives']} matched collectives), offsets {offs}")
        console.print(f"clock: {how}; residual {c['residual_us'] / 1e3:.3f} ms (no cross-rank claim below it)",
                      highlight=False)
    t = Table(title="Where the step goes (median over the window's steps)", title_justify="left")
    for col in ("rank", "step ms", "data %", "compute %", "exposed comm %", "idle %", "overlap %",
                "grad all-reduces/step", "late ms/step"):
        t.add_column(col, justify="right")
    for r in rep["ranks"]:
        m, col = r["median"], r["collectives"]
        t.add_row(str(r["rank"]), f"{m['step_ms']:.1f}", f"{m['data_pct']:.1f}", f"{m['compute_pct']:.1f}",
                  f"{m['comm_pct']:.1f}", f"{m['idle_pct']:.1f}", f"{m['overlap_pct']:.0f}",
                  f"{col['grad_allreduce_per_step']:g}", f"{r['lateness_ms']['per_step']:.2f}")
    console.print(t)
    if any(r["median"].get("shares_from") == "gpu_kernels" for r in rep["ranks"]):
        console.print("  shares from the GPU timeline (HTA's reading): compute = kernels on any stream, exposed "
                      "comm = nccl kernels with no compute kernel running, overlap = compute kernels during "
                      "nccl kernels / nccl kernel time; the section scores stay the main thread's", highlight=False)
    sec = rep["sections"]
    if sec.get("scores") and rep["world"] > 1:
        names = sorted(next(iter(sec["scores"].values())))
        st = Table(title="Section scores (fastest rank's median / this rank's, exposed communication left out; "
                         "red: a straggler, docs/diagnose.md)", title_justify="left")
        st.add_column("rank", justify="right")
        for n in names:
            st.add_column(n, justify="right")
        flagged = {(str(x["rank"]), x["section"]) for x in sec.get("stragglers", [])}
        for r, sc in sec["scores"].items():
            st.add_row(r, *[_score(sc[n], sec["median_ms"][r][n], (r, n) in flagged) for n in names])
        console.print(st)
        if sec.get("slowest"):
            s = sec["slowest"]
            console.print(f"slowest rank: {s['rank']} (busy {s['busy_ms']:.1f} ms a step), its weakest section "
                          f"{s['section']} (score {s['score']:.2f})", highlight=False)
    mem = [(r["rank"], r.get("memory")) for r in rep["ranks"] if r.get("memory")]
    if mem:
        cats = [k for k in ("Parameter", "Buffer", "Gradient", "Activation", "Optstate", "Temp", "Other", "Total")
                if any(k in (m.get("peak_mib") or {}) for _, m in mem)]
        src = ("CUDA memory snapshot" if mem[0][1].get("source") == "cuda_snapshot" else "torch MemTracker")
        mt = Table(title=f"Peak memory by category, MiB ({src}, step {mem[0][1].get('step')})",
                   title_justify="left")
        for col in ("rank", *cats):
            mt.add_column(col, justify="right")
        for r, m in mem:
            if "error" in m:
                mt.add_row(str(r), m["error"][:60], *[""] * (len(cats) - 1))
            else:
                mt.add_row(str(r), *[f"{m['peak_mib'].get(c, 0):.2f}" for c in cats])
        console.print(mt)
        chk = [(r, m["check"]) for r, m in mem if m.get("check")]
        if chk:
            console.print("  snapshot replay: peak " + ", ".join(
                f"rank {r} {c['replay_peak'] / (1 << 20):.2f} MiB requested (allocator's max_memory_allocated, "
                f"its rounded-up blocks: {(c.get('allocator_peak') or 0) / (1 << 20):.2f})" for r, c in chk)
                + "; the pickle opens in pytorch.org/memory_viz", highlight=False)
        grads = max(r["collectives"]["grad_bytes_per_step"] for r in rep["ranks"])
        if grads and all((m.get("peak_mib") or {}).get("Gradient", 1) == 0 for _, m in mem):
            console.print(f"  gradients: {grads / (1 << 20):.2f} MiB a step live in DDP's buckets "
                          "(gradient_as_bucket_view), allocated before the tracked step: not in the columns above",
                          highlight=False)
    from tandem.diagnose import against_plan, efficiency, incidents, steptime, whatif

    against_plan.render(rep, console)
    against_plan.render_from_plan(rep, console)
    efficiency.render(rep, console)
    whatif.render(rep, console)
    steptime.render(rep, console)
    if rep.get("metrics"):
        console.print(f"metrics.jsonl, same steps: step {rep['metrics']['step_ms']:.1f} ms, "
                      f"data {rep['metrics']['data_pct']:.1f}%", highlight=False)
    incidents.render(rep, console)
    render_verdicts(rep, console)


def render_verdicts(rep: dict, console: Console) -> None:
    if not rep["verdicts"]:
        console.print("[green]no findings[/]: no rank is data-bound, communication is not exposed above the "
                      "threshold, and no section is a straggler")
    for v in rep["verdicts"]:
        console.print(f"[bold yellow]{v['title']}[/]", highlight=False)
        for e in v["evidence"]:
            console.print(f"  evidence: {e}", highlight=False)
        console.print(f"  [bold]change[/]: {v['change']}", highlight=False)


def _score(score: float, ms: float, straggler: bool) -> str:
    s = f"{score:.2f} ({ms:.1f} ms)"
    return f"[bold red]{s}[/]" if straggler else s
