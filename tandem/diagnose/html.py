"""`tandem diagnose RUN_DIR --html report.html`: one self-contained page (inline SVG, no scripts).

A timeline of one step (the window's middle one) on the aligned clock: a swim lane per rank with
its trainer phases, the collectives drawn on top as thin bars; the shares table; the memory bars;
the verdicts with their evidence.
"""

from __future__ import annotations

import html
from pathlib import Path

from tandem.diagnose.trace import PHASE_PREFIX, RankTrace

COLORS = {"data": "#e6a700", "forward": "#3b7dd8", "backward": "#6a4cc2", "forward_backward": "#4f63c9",
          "optimizer": "#2f9e6e", "sync": "#c2416b", "checkpoint": "#777777", "clock": "#bbbbbb"}
MEM_COLORS = {"Parameter": "#3b7dd8", "Buffer": "#9ab7e6", "Gradient": "#6a4cc2", "Activation": "#e6a700",
              "Optstate": "#2f9e6e", "Temp": "#c2416b", "Other": "#999999"}
W, LANE, LEFT = 1000, 46, 70


def _timeline(rep: dict, traces: list[RankTrace]) -> str:
    step = rep["steps"][len(rep["steps"]) // 2]
    off = {int(k): v for k, v in rep["clock"]["offsets_us"].items()}
    spans = {t.rank: (t.steps[step][0] - off.get(t.rank, 0.0), t.steps[step][1] - off.get(t.rank, 0.0))
             for t in traces}
    t0, t1 = min(a for a, _ in spans.values()), max(b for _, b in spans.values())
    x = lambda t: LEFT + (t - t0) / max(t1 - t0, 1e-9) * (W - LEFT - 10)  # noqa: E731
    out = [f'<svg width="{W}" height="{LANE * len(traces) + 30}" xmlns="http://www.w3.org/2000/svg" '
           'font-family="sans-serif" font-size="11">']
    for i, t in enumerate(traces):
        y, d = 10 + i * LANE, off.get(t.rank, 0.0)
        a, b = spans[t.rank]
        out.append(f'<text x="4" y="{y + 20}">rank {t.rank}</text>')
        out.append(f'<rect x="{x(a):.1f}" y="{y}" width="{x(b) - x(a):.1f}" height="30" fill="#f2f2f2"/>')
        for p in t.phases:
            s, e = max(p.start - d, a), min(p.end - d, b)
            if e <= s:
                continue
            name = p.name[len(PHASE_PREFIX):]
            out.append(f'<rect x="{x(s):.1f}" y="{y}" width="{max(x(e) - x(s), 0.5):.1f}" height="30" '
                       f'fill="{COLORS.get(name, "#aaa")}"><title>{html.escape(name)} {(e - s) / 1e3:.2f} ms'
                       '</title></rect>')
        for c in t.comms:
            s, e = max(c.start - d, a), min(c.end - d, b)
            if e <= s:
                continue
            out.append(f'<rect x="{x(s):.1f}" y="{y + 32}" width="{max(x(e) - x(s), 0.5):.1f}" height="6" '
                       f'fill="#d33"><title>{html.escape(c.name)} {(e - s) / 1e3:.2f} ms, {c.nbytes} B</title></rect>')
    out.append(f'<text x="{LEFT}" y="{LANE * len(traces) + 24}">step {step}: {(t1 - t0) / 1e3:.1f} ms on the '
               'aligned clock; red: collectives (gloo/nccl spans)</text></svg>')
    legend = " ".join(f'<span style="background:{c};color:#fff;padding:1px 5px">{n}</span>' for n, c in COLORS.items())
    return "\n".join(out) + f"<p>{legend}</p>"


def _memory(rep: dict) -> str:
    mem = [(r["rank"], (r.get("memory") or {}).get("peak_mib")) for r in rep["ranks"]]
    mem = [(r, m) for r, m in mem if m]
    if not mem:
        return "<p>No memory measurement (profile.memory off, or the run ended with the window).</p>"
    vs = rep.get("memory_vs_plan") or {}
    plan = None
    if vs.get("plan"):  # the planner's prediction for the run's spec, in MemTracker's categories
        pm = vs["plan"]["mib"]
        plan = {"Parameter": pm["params"], "Gradient": pm["grads"], "Optstate": pm["optimizer"],
                "Activation": pm["activations"], "Total": vs["plan"]["total_mib"]}
    top = max([m.get("Total", 0) for _, m in mem] + [plan["Total"] if plan else 0]) or 1
    rows = []
    for label, m in [(f"rank {r}", m) for r, m in mem] + ([(f"plan ({vs['plan']['strategy']})", plan)] if plan else []):
        bars = "".join(f'<div title="{k} {m.get(k, 0):.2f} MiB" style="display:inline-block;height:16px;'
                       f'width:{600 * m.get(k, 0) / top:.1f}px;background:{c}"></div>' for k, c in MEM_COLORS.items())
        rows.append(f"<div>{html.escape(label)} {bars} {m.get('Total', 0):.2f} MiB</div>")
    legend = " ".join(f'<span style="background:{c};color:#fff;padding:1px 5px">{k}</span>'
                      for k, c in MEM_COLORS.items())
    return "\n".join(rows) + f"<p>{legend}</p>"


def write(rep: dict, traces: list[RankTrace], out: Path) -> None:
    cols = ("step_ms", "data_pct", "compute_pct", "comm_pct", "idle_pct", "overlap_pct")
    shares = "".join("<tr><td>%d</td>%s</tr>" % (r["rank"], "".join(f"<td>{r['median'][c]:.1f}</td>" for c in cols))
                     for r in rep["ranks"])
    verdicts = "".join(f"<h3>{html.escape(v['title'])}</h3><ul>"
                       + "".join(f"<li>{html.escape(e)}</li>" for e in v["evidence"])
                       + f"</ul><p><b>change:</b> {html.escape(v['change'])}</p>" for v in rep["verdicts"]) \
        or "<p><b>no findings</b></p>"
    c = rep["clock"]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>tandem diagnose</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} td,th{{padding:2px 8px;text-align:right}}</style>
</head><body><h1>tandem diagnose: {html.escape(str(rep.get('run_dir') or ''))}</h1>
<p>{rep['world']} rank(s), steps {rep['steps'][0]}-{rep['steps'][-1]}; clock {c['method']}, residual
{c['residual_us'] / 1e3:.3f} ms.</p>
<h2>One step, every rank</h2>{_timeline(rep, traces)}
<h2>Where the step goes (median over the window)</h2><table><tr><th>rank</th><th>step ms</th><th>data %</th>
<th>compute %</th><th>exposed comm %</th><th>idle %</th><th>overlap %</th></tr>{shares}</table>
<h2>Peak memory by category</h2>{_memory(rep)}
<h2>Verdicts</h2>{verdicts}</body></html>"""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page)
    tmp.replace(out)
