"""`tandem diagnose RUN_A --compare RUN_B`: what a change did, from the two runs' reports."""

from __future__ import annotations

from statistics import median

from rich.console import Console
from rich.table import Table

ROWS = (("step ms", "step_ms"), ("data %", "data_pct"), ("compute %", "compute_pct"),
        ("exposed comm %", "comm_pct"), ("idle %", "idle_pct"), ("overlap %", "overlap_pct"))


def summary(rep: dict) -> dict:
    """Median over ranks of each rank's median; the slowest rank's step (the one the others wait for)."""
    out = {k: median(r["median"][k] for r in rep["ranks"]) for _, k in ROWS}
    out["step_ms"] = max(r["median"]["step_ms"] for r in rep["ranks"])
    out["grad_allreduce_per_step"] = median(r["collectives"]["grad_allreduce_per_step"] for r in rep["ranks"])
    out["verdicts"] = sorted(v["title"] for v in rep["verdicts"]) or ["no findings"]
    return out


def render(a: dict, b: dict, names: tuple[str, str], console: Console) -> None:
    sa, sb = summary(a), summary(b)
    t = Table(title="Before / after (median over ranks; step: the slowest rank's)", title_justify="left")
    for col in ("", names[0], names[1], "change"):
        t.add_column(col, justify="right" if col else "left")
    for label, k in ROWS + (("grad all-reduces/step", "grad_allreduce_per_step"),):
        x, y = sa[k], sb[k]
        ch = f"{y / x:.2f}x" if k == "step_ms" and x else f"{y - x:+.1f}"
        t.add_row(label, f"{x:.1f}", f"{y:.1f}", ch)
    console.print(t)
    for name, s in zip(names, (sa, sb)):
        console.print(f"{name}: " + "; ".join(s["verdicts"]), highlight=False)
