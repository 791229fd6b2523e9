"""Alpha-beta fits of measured collectives and the calibration file `tandem plan` reads.

Model: t(size) = alpha + beta * size, with ``size`` as nccl-tests defines it
(the full buffer; see tandem.bench.collectives). Ordinary least squares on raw
times would let the largest message decide everything and leave alpha
meaningless (often negative); minimising the *relative* error gives every size
the same say, so alpha tracks the small-message plateau and beta the
large-message slope.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CALIBRATION_SCHEMA = "tandem.calibration/1"
LINKS_IN_CALIBRATION = ("intra_node", "inter_node")  # "world" mixes both: kept in the results only


@dataclass
class Fit:
    alpha_s: float
    beta_s_per_byte: float
    max_rel_err: float     # worst |model/measured - 1| over the points: how far to trust the line

    def predict(self, size: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * size


def fit_alpha_beta(sizes: list[float], times: list[float]) -> Fit:
    m = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if len(m) == 0:
        raise ValueError("no points to fit")
    if len(m) == 1:
        return Fit(float(t[0]), 0.0, 0.0)
    # Weighted least squares: rows divided by t, so residuals are relative errors.
    a = np.stack([1.0 / t, m / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha <= 0:
        # Noise hid the latency floor. The smallest message's time is alpha plus a negligible
        # beta * size, and the planner needs a positive latency: take it, and fit the slope
        # to what remains (relative least squares again, through that intercept).
        alpha = float(t[np.argmin(m)])
        rest = (t - alpha) / t
        beta = float(np.sum(rest * m / t) / np.sum((m / t) ** 2))
    if beta <= 0:  # flat curve (all latency): no slope is measurable at these sizes
        beta = 0.0
        alpha = float(np.median(t))
    pred = alpha + beta * m
    return Fit(float(alpha), float(beta), float(np.max(np.abs(pred / t - 1.0))))


def _fit_rows(rows: list[dict]) -> dict:
    """{link: {collective: {alpha_s, beta_s_per_byte, busbw_Bps, ...}}} from result rows.

    In-place rows are fitted where they exist, out-of-place rows otherwise: torch has
    no out-of-place all_reduce/reduce, so their out-of-place time includes a local
    copy that is no part of the link, and DDP reduces its buckets in place anyway.
    """
    by: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        if not r["ok"]:
            continue  # a wrong result is no measurement
        key = (r["link"], r["collective"])
        cur = by.setdefault(key, {}).get(r["size"])
        if cur is None or (cur["mode"] == "out" and r["mode"] == "in"):
            by[key][r["size"]] = r
    out: dict = {}
    for (link, coll), pts in by.items():
        sizes = sorted(pts)
        f = fit_alpha_beta(sizes, [pts[s]["time_us"] * 1e-6 for s in sizes])
        largest = pts[sizes[-1]]
        out.setdefault(link, {})[coll] = {
            "alpha_s": f.alpha_s, "beta_s_per_byte": f.beta_s_per_byte,
            "busbw_Bps": largest["busbw_GBps"] * 1e9, "largest_size": sizes[-1],
            "group_size": largest["group_size"], "fit_max_rel_err": f.max_rel_err,
        }
    return out


def fits(result: dict) -> dict:
    return _fit_rows(result["rows"])


def calibration(result: dict, fitted: dict | None = None, previous: dict | None = None) -> dict:
    """The calibration document (schema tandem.calibration/1, documented in docs/bench.md)."""
    fitted = fitted if fitted is not None else fits(result)
    links = {}
    for link in LINKS_IN_CALIBRATION:
        colls = fitted.get(link)
        if not colls:
            continue
        # The link's headline numbers come from all_reduce; without it, from the first measured.
        head_name = "all_reduce" if "all_reduce" in colls else next(iter(colls))
        head = colls[head_name]
        links[link] = {"bandwidth_Bps": head["busbw_Bps"], "latency_s": head["alpha_s"],
                       "source_collective": head_name, "group_size": head["group_size"],
                       "collectives": colls}
    compute = dict((previous or {}).get("compute") or {})
    flops = dict(compute.get("achieved_flops") or {})
    flops.update((result.get("compute") or {}).get("achieved_flops") or {})
    compute["achieved_flops"] = flops
    return {
        "schema": CALIBRATION_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": result["host"], "backend": result["backend"], "device": result["device"],
        "world_size": result["world_size"], "nnodes": result["nnodes"],
        # the cluster measured, for the planner: workers per node, machines (simulated nodes share one)
        "nproc_per_node": result.get("local_world_size") or result["world_size"] // max(1, result["nnodes"]),
        "hosts": result.get("hosts") or [result["host"]],
        **{k: result[k] for k in ("device_name", "device_memory_bytes", "cores") if result.get(k) is not None},
        "links": links, "compute": compute,
    }


def write_calibration(path: Path, result: dict, fitted: dict | None = None) -> dict:
    """Write (or refresh) the calibration; compute numbers from an earlier `bench train` survive."""
    previous = None
    if path.is_file():
        try:
            previous = json.loads(path.read_text())
        except (OSError, ValueError):
            previous = None
    doc = calibration(result, fitted, previous)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return doc
