"""`tandem bench serve EXPORT_DIR --vs-batch-1`: what dynamic batching buys, measured in one run.

Two servers of the same export start on loopback side by side (one replica each, one with
``--max-batch`` N, one with ``--max-batch 1``; an idle server costs nothing). The same open-loop load
(bench/serve.py's generator) then steps up in rate, x1.5 a step, alternating between the two servers
at each rate so that drift on a shared machine hits both; a rate that fails is measured once more
before a server's search stops (a load spike from elsewhere hits one side at a time). A server
*sustains* a rate when every request was answered 200, its p99 from the intended send time is within
``--p99-ms`` and its latency did not climb through the run (a queue building up; see ``sustained``).
Its capacity is the highest rate it sustained; the headline is capacity(batched) / capacity(batch 1),
the throughput ratio at the same p99 bound. ``--vs-static`` runs the same search on two servers with the
same --max-batch, continuous against static batching, under a mixed load (every 4th request long, the
others 2 tokens), where a static batch holds its short requests until its long one finishes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.serve import run_load


BATCH1 = {"batched": ("max-batch {mb}", ()), "batch1": ("max-batch 1", ("--max-batch", "1"))}
STATIC = {"batched": ("continuous", ()), "batch1": ("static", ("--batching", "static"))}
# this tandem's folder on the servers' PYTHONPATH: bench/*.py run from a checkout, not an install
HOME = str(Path(__file__).resolve().parents[2])


def _start(export: Path, run_dir: Path, max_batch: int, batch_wait_ms: float,
           extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "front.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", str(export), "--port", "0", "--run-dir",
                             str(run_dir), "--max-batch", str(max_batch), "--batch-wait-ms", str(batch_wait_ms),
                             "--max-queue", "4096", *extra], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                HOME, os.environ.get("PYTHONPATH")]))})
    info, end = run_dir / "server.json", time.monotonic() + 300
    while time.monotonic() < end and proc.poll() is None:
        if info.is_file() and "ready:" in (run_dir / "front.log").read_text():
            return proc, json.loads(info.read_text())["url"]
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server with --max-batch {max_batch} did not become ready: "
                       f"{(run_dir / 'front.log').read_text()[-500:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sustained(res: dict, p99_ms: float) -> bool:
    """Every request 200, p99 within the bound, and no queue building up: the last quarter's median
    latency at most twice the first quarter's plus 50 ms (an overload that a short run's p99 bound
    would let pass shows as latency rising through the run)."""
    return res["failed"] == 0 and res["latency_ms"]["p99"] <= p99_ms and \
        res["p50_last_quarter_ms"] <= 2 * res["p50_first_quarter_ms"] + 50


def step_rates(urls: dict[str, str], labels: dict[str, str] | None = None, start_rate: float = 5.0,
               step: float = 1.5, max_steps: int = 12, duration: float = 3.0, p99_ms: float = 1000.0,
               say=print, **load) -> dict:
    """The capacity search: the same rates, stepped up x``step`` from ``start_rate``, offered to each server
    in turn at each rate (drift on a shared machine hits them all); a server's search ends at the first
    rate it does not sustain twice in a row. ``load``: run_load's options (max_new_tokens, mixed, info).
    Returns each step's row ({"rate", server: {...}}), each server's highest sustained rate, and the
    servers still sustaining at the last step (their capacity is at least that rate)."""
    labels = labels or {k: k for k in urls}
    going, rate, rows = set(urls), start_rate, []
    best = {k: 0.0 for k in urls}
    for _ in range(max_steps):
        if not going:
            break
        row = {"rate": rate}
        for k in [k for k in urls if k in going]:
            for _attempt in range(2):   # a failed rate is measured once more: one load spike from elsewhere
                res = asyncio.run(run_load(urls[k], rate, duration,  # must not end a server's search
                                           timeout_s=max(60.0, 4 * duration), **load))
                ok = sustained(res, p99_ms)
                if ok:
                    break
            row[k] = {"throughput_rps": res["throughput_rps"], "p99_ms": res["latency_ms"]["p99"],
                      "failed": res["failed"], "sustained": ok}
            if ok:
                best[k] = max(best[k], rate)
            else:
                going.discard(k)
        rows.append(row)
        say("  " + _row_text(row, labels))
        rate *= step
    return {"steps": rows, "capacity_rps": best, "still_sustaining": sorted(going)}


def search_capacity(url: str, start_rate: float = 5.0, step: float = 1.5, max_steps: int = 12,
                    duration: float = 3.0, p99_ms: float = 1000.0, max_new_tokens: int = 8,
                    say=print) -> tuple[float, list[dict]]:
    """One server's capacity by ``step_rates``'s rule: the highest sustained rate, and each step's row."""
    res = step_rates({"one": url}, {"one": ""}, start_rate, step, max_steps, duration, p99_ms, say=say,
                     max_new_tokens=max_new_tokens)
    return res["capacity_rps"]["one"], [{"rate": r["rate"], **r["one"]} for r in res["steps"]]


def compare(export: Path, max_batch: int = 32, batch_wait_ms: float = 5.0, start_rate: float = 5.0,
            step: float = 1.5, max_steps: int = 12, duration: float = 3.0, p99_ms: float = 1000.0,
            max_new_tokens: int = 8, say=print, sides: dict | None = None, mixed: bool = False) -> dict:
    """``sides``: BATCH1 (the default) or STATIC, the two servers' labels and extra flags."""
    sides = {k: (label.format(mb=max_batch), extra) for k, (label, extra) in (sides or BATCH1).items()}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-serve-") as tmp:
        procs = {}
        try:
            for k, (_, extra) in sides.items():
                procs[k] = _start(export, Path(tmp) / k, max_batch, batch_wait_ms, extra)
            found = step_rates({k: url for k, (_, url) in procs.items()}, {k: v[0] for k, v in sides.items()},
                               start_rate, step, max_steps, duration, p99_ms, say=say,
                               max_new_tokens=max_new_tokens, mixed=mixed)
        finally:
            for p, _ in procs.values():
                _stop(p)
    best = found["capacity_rps"]
    ratio = best["batched"] / best["batch1"] if best["batch1"] > 0 else float("nan")
    return {"export": str(export), "sides": {k: v[0] for k, v in sides.items()}, "mixed": mixed,
            "max_batch": max_batch, "batch_wait_ms": batch_wait_ms, "p99_ms": p99_ms,
            "duration_s": duration, "steps": found["steps"], "capacity_rps": best, "ratio": ratio,
            "still_sustaining": found["still_sustaining"],   # their capacity is at least the last rate (max_steps)
            "cpus": os.cpu_count()}


def _row_text(row: dict, labels: dict[str, str]) -> str:
    cells = []
    for k, label in labels.items():
        c = row.get(k)
        cell = "(stopped)".ljust(34) if c is None else \
            f"{c['throughput_rps']:7.1f} req/s  p99 {c['p99_ms']:8.1f} ms  {'ok ' if c['sustained'] else 'NO '}"
        cells.append(f"{label:<13s} {cell}" if label else cell)
    return (f"{row['rate']:7.1f} req/s offered: " + "  |  ".join(cells)).rstrip()


def print_summary(res: dict, say=print) -> None:
    cap = res["capacity_rps"]
    more = {k: " (or more: still sustained at the last step)" if k in res["still_sustaining"] else ""
            for k in cap}
    a, b = res["sides"]["batched"], res["sides"]["batch1"]
    say(f"capacity (every request 200, p99 <= {res['p99_ms']:g} ms, latency not climbing): "
        f"{a} {cap['batched']:.1f} req/s{more['batched']}, {b} {cap['batch1']:.1f} req/s{more['batch1']}")
    say(f"ratio: {res['ratio']:.2f}x the throughput of {b} at the same p99 bound ({a})")
