"""How the planner writes numbers: SI prefixes, seconds, GiB, shares. Imports nothing, so every layer can."""

from __future__ import annotations


def si(x: float, unit: str = "B") -> str:
    for k, p in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= p:
            return f"{x / p:.4g} {k}{unit}"
    return f"{x:.4g} {unit}"


def ms(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.4g} s"


def gib(x: float) -> str:
    g = x / 1024**3
    return f"{g:.3g} GiB" if g >= 1 or g == 0 else f"{x / 1024**2:.4g} MiB"


def pct(x: float) -> str:
    """A share to three significant digits (0.0504%, 3.64%, 13.1%): small shares stay visible."""
    return f"{100 * x:.3g}%"


def human_time(sec: float) -> str:
    if sec >= 86400:
        return f"{sec / 86400:.3g} days"
    if sec >= 3600:
        return f"{sec / 3600:.3g} hours"
    return f"{sec:.3g} s"
