"""`tandem bench serve --plot latency.png`: each request's latency against its intended send time (the
open loop's schedule, so a stall shows as a ramp, not as a gap), errors marked by code at the top of the
plot, the replica kill and its return marked as vertical lines."""

from __future__ import annotations

from pathlib import Path

from tandem.core.errors import ConfigError


def require_matplotlib(path: Path | None = None):
    """pyplot on the Agg backend, or one clear error before any load is sent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("matplotlib is not installed", field="--plot", value=str(path or ""),
                          fix="pip install 'tandem[plot]', or leave out --plot") from None
    return plt


def check_path(path: Path) -> None:
    if path.suffix.lower() != ".png":
        raise ConfigError("expected a .png path", field="--plot", value=str(path), fix="give --plot FILE.png")


def x_extent(res: dict) -> float:
    """The x-axis's right end: the run, or past it to the replica's return when that came later (a mark
    outside the axis is not drawn)."""
    kill = res.get("kill") or {}
    end = float(res["duration_s"])
    if kill.get("at_s") is not None and kill.get("back_after_s") is not None:
        end = max(end, 1.05 * (kill["at_s"] + kill["back_after_s"]))
    return end


def plot_latency(res: dict, path: Path) -> Path:
    plt = require_matplotlib(path)
    samples = res["samples"]
    ok = [(d, 1000 * lat) for d, lat, c in samples if c == "200"]
    bad: dict[str, list[tuple[float, float]]] = {}
    for d, lat, c in samples:
        if c != "200":
            bad.setdefault(c, []).append((d, 1000 * lat))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if ok:
        ax.scatter([d for d, _ in ok], [m for _, m in ok], s=6, color="tab:blue", label=f"200 ({len(ok)})")
    top = max([m for _, m in ok] + [1.0])
    for (code, pts), color in zip(sorted(bad.items()), ("tab:red", "tab:orange", "tab:purple", "tab:brown")):
        # failed requests are drawn at their latency when they have one; a marker row makes them visible
        ax.scatter([d for d, _ in pts], [m for _, m in pts], s=22, marker="x", color=color,
                   label=f"{code} ({len(pts)})")
    kill = res.get("kill")
    if kill and kill.get("at_s") is not None:
        ax.axvline(kill["at_s"], color="black", linestyle="--", label=f"SIGKILL replica pid {kill['pid']}")
        if kill.get("back_after_s") is not None:
            ax.axvline(kill["at_s"] + kill["back_after_s"], color="green", linestyle=":",
                       label=f"replica back (+{kill['back_after_s']:.1f} s)")
    lat = res["latency_ms"]
    ax.set_title(f"{res['route']} at {res['rate']:g} req/s, open loop: p50 {lat['p50']:.0f} ms, "
                 f"p99 {lat['p99']:.0f} ms, {res['failed']} failed of {res['sent']}", fontsize=10)
    ax.set_xlabel("intended send time (s from start)")
    ax.set_ylabel("latency from intended send (ms)")
    p50 = lat["p50"] if lat["p50"] == lat["p50"] else 1.0   # NaN when nothing succeeded
    ax.set_yscale("log" if top > 50 * max(1.0, p50) else "linear")   # a stall's ramp would flatten the rest
    ax.set_xlim(0, x_extent(res))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
