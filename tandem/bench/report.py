"""Rendering of `tandem bench comm` results: rich tables, CSV, and the busbw plot."""

from __future__ import annotations

import csv
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tandem.core.units import format_size

CSV_FIELDS = ["link", "group_size", "collective", "size", "count", "dtype", "mode", "time_us",
              "algbw_GBps", "busbw_GBps", "max_err", "ok"]


def _cells(r: dict | None) -> list[str]:
    if r is None:
        return ["", "", "", ""]
    if not r["ok"]:
        return [f"{r['time_us']:.1f}", "[bold red]WRONG[/]", "[bold red]WRONG[/]", f"[red]{r['max_err']:g}[/]"]
    return [f"{r['time_us']:.1f}", f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}",
            "0" if r.get("checked", True) else "-"]


def tables(result: dict) -> list[Table]:
    """One table per link class, laid out like nccl-tests: out-of-place | in-place per size."""
    out = []
    links: dict[str, list[dict]] = {}
    for r in result["rows"]:
        links.setdefault(r["link"], []).append(r)
    for link, rows in links.items():
        n = rows[0]["group_size"]
        t = Table(title=f"{link}: {n} ranks, {result['backend']} on {result['device']}, "
                        f"{result['options']['dtype']}, {result['options']['iters']} iters",
                  title_justify="left", header_style="bold")
        t.add_column("collective", no_wrap=True)
        t.add_column("size", justify="right")
        t.add_column("count", justify="right")
        for side in ("out", "in"):
            label = "out-of-place" if side == "out" else "in-place"
            t.add_column(f"{label}\ntime (us)", justify="right")
            t.add_column("algbw\n(GB/s)", justify="right")
            t.add_column("busbw\n(GB/s)", justify="right")
            t.add_column("#wrong", justify="right")
        keyed: dict[tuple[str, int], dict[str, dict]] = {}
        for r in rows:
            keyed.setdefault((r["collective"], r["size"]), {})[r["mode"]] = r
        last = None
        for (coll, size), modes in keyed.items():
            if last is not None and coll != last:
                t.add_section()
            last = coll
            any_row = modes.get("out") or modes.get("in")
            t.add_row(coll, format_size(size), str(any_row["count"]), *_cells(modes.get("out")),
                      *_cells(modes.get("in")))
        out.append(t)
    return out


def fit_table(fitted: dict) -> Table:
    t = Table(title="alpha-beta fit: t(size) = alpha + beta * size", title_justify="left", header_style="bold")
    for col, just in (("link", "left"), ("collective", "left"), ("alpha (us)", "right"),
                      ("1/beta (GB/s)", "right"), ("busbw @ largest (GB/s)", "right"), ("fit err", "right")):
        t.add_column(col, justify=just)
    for link, colls in fitted.items():
        for name, f in colls.items():
            inv = f"{1e-9 / f['beta_s_per_byte']:.3f}" if f["beta_s_per_byte"] > 0 else "inf"
            t.add_row(link, name, f"{f['alpha_s'] * 1e6:.1f}", inv,
                      f"{f['busbw_Bps'] / 1e9:.3f} ({format_size(f['largest_size'])})",
                      f"{f['fit_max_rel_err'] * 100:.0f}%")
    return t


def print_report(result: dict, fitted: dict, console: Console) -> None:
    for t in tables(result):
        console.print(t)
    if fitted:
        console.print(fit_table(fitted))
    if result.get("compute", {}).get("achieved_flops"):
        f = result["compute"]["achieved_flops"]
        console.print("matmul on rank 0: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in f.items()))


def write_csv(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            w.writerow(r)


def write_plot(path: Path, result: dict) -> None:
    """busbw against size, one panel per link class, one line per collective (out-of-place)."""
    try:
        import matplotlib
    except ImportError:
        from tandem.core.errors import ConfigError

        raise ConfigError("matplotlib is not installed", field="--plot", value=str(path),
                          fix="pip install 'tandem[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in result["rows"]))
    fig, axes = plt.subplots(1, max(1, len(links)), figsize=(6 * max(1, len(links)), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        rows = [r for r in result["rows"] if r["link"] == link and r["ok"]]
        for coll in dict.fromkeys(r["collective"] for r in rows):
            pts = sorted((r["size"], r["busbw_GBps"]) for r in rows if r["collective"] == coll and r["mode"] == "out")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=coll)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        n = rows[0]["group_size"] if rows else "?"
        ax.set_title(f"{link} ({n} ranks, {result['backend']})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
