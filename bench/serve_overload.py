"""Overload: at 2x the measured capacity, the excess is refused at once and admitted requests keep their latency.

    python bench/serve_overload.py EXPORT_DIR [--max-queue 32] [--max-batch 32] [--duration 6]
                                              [--p99-ms 1000] [--start-rate 20] [--json FILE]

`tandem serve EXPORT_DIR` (1 replica, --max-batch) on loopback, driven by `tandem bench serve`'s
open-loop generator (latency from each request's intended send time):
  1. capacity: tandem/bench/serve_batching.py's search (x1.5 steps; sustained = every request 200,
     p99 within --p99-ms, latency not climbing) on a server whose queue never fills (--max-queue 4096)
  2. then a server with the bounded --max-queue: unloaded (--unloaded-rate req/s for --duration s),
     2x that capacity for --duration s open loop, unloaded again; the baseline is the lower of the two
     unloaded p99s (a spike from elsewhere in one of them must not flatter the ratio)
Printed: how many of the overload's requests were answered 429, how many of those carried Retry-After,
how fast a 429 came back, the count of 5xx (the claim is 0) and of other failures, and admitted p99 /
unloaded p99 as a ratio (the target is at most 2). The admitted latency is bounded by the queue: a
request admitted behind --max-queue others waits for them, so the ratio depends on --max-queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.bench.serve import percentile, run_load  # noqa: E402
from tandem.bench.serve_batching import _start, _stop, search_capacity  # noqa: E402


def overload(export: Path, max_queue: int = 32, max_batch: int = 32, duration: float = 6.0, p99_ms: float = 1000.0,
             start_rate: float = 20.0, unloaded_rate: float = 5.0, max_new_tokens: int = 8, say=print) -> dict:
    load = dict(max_new_tokens=max_new_tokens, timeout_s=max(60.0, 4 * duration))
    with tempfile.TemporaryDirectory(prefix="tandem-bench-overload-") as tmp:
        # capacity with a queue that never fills (_start's --max-queue 4096): what the replica can do,
        # not where a small queue's bursts start to refuse
        proc, url = _start(export, Path(tmp) / "capacity", max_batch, 5.0)
        try:
            say(f"capacity search (p99 <= {p99_ms:g} ms, every request 200, latency not climbing):")
            cap, steps = search_capacity(url, start_rate, duration=duration, p99_ms=p99_ms,
                                         max_new_tokens=max_new_tokens, say=say)
        finally:
            _stop(proc)
        if cap <= 0:
            raise RuntimeError(f"no rate from {start_rate:g} req/s up was sustained; give a lower --start-rate")
        proc, url = _start(export, Path(tmp) / "bounded", max_batch, 5.0, ("--max-queue", str(max_queue)))
        try:
            bases = [asyncio.run(run_load(url, unloaded_rate, duration, **load))]
            over = asyncio.run(run_load(url, 2 * cap, duration, **load))
            bases.append(asyncio.run(run_load(url, unloaded_rate, duration, **load)))
        finally:
            _stop(proc)
    for when, b in zip(("before", "after"), bases):
        say(f"unloaded (--max-queue {max_queue}) {when} the overload: {unloaded_rate:g} req/s for {duration:g} s: "
            f"p99 {b['latency_ms']['p99']:.1f} ms, codes {b['codes']}")
    # the lower of the two: a load spike from elsewhere during one of them must not flatter the ratio
    base = min(bases, key=lambda b: b["latency_ms"]["p99"])
    codes = over["codes"]
    rejected = sorted(lat for _, lat, c in over["samples"] if c == "429")
    five = sum(n for c, n in codes.items() if c.startswith("5"))
    return {"export": str(export), "max_queue": max_queue, "max_batch": max_batch, "duration_s": duration,
            "p99_bound_ms": p99_ms, "unloaded_rate": unloaded_rate, "unloaded_p99_ms": base["latency_ms"]["p99"],
            "unloaded_p99s_ms": [b["latency_ms"]["p99"] for b in bases],
            "capacity_rps": cap, "capacity_steps": steps, "overload_rate": 2 * cap, "sent": over["sent"],
            "codes": codes, "answered_200": codes.get("200", 0), "answered_429": codes.get("429", 0),
            "429_with_retry_after": over["retry_after"].get("429", 0), "5xx": five,
            "other_failures": over["sent"] - codes.get("200", 0) - codes.get("429", 0) - five,
            "429_p99_ms": 1000 * percentile(rejected, 99), "admitted_p99_ms": over["latency_ms"]["p99"],
            "admitted_throughput_rps": over["throughput_rps"],
            "ratio": over["latency_ms"]["p99"] / base["latency_ms"]["p99"], "cpus": os.cpu_count()}


def report(r: dict, say=print) -> None:
    say(f"overload: {r['overload_rate']:.1f} req/s (2x capacity {r['capacity_rps']:.1f}) for {r['duration_s']:g} s, "
        f"--max-queue {r['max_queue']}, --max-batch {r['max_batch']}: {r['sent']} sent")
    say(f"  200: {r['answered_200']} ({r['admitted_throughput_rps']:.1f} req/s)   429: {r['answered_429']} "
        f"({r['429_with_retry_after']} with Retry-After; p99 {r['429_p99_ms']:.1f} ms from intended send)")
    say(f"  5xx: {r['5xx']}   other failures: {r['other_failures']}   codes: {r['codes']}")
    say(f"ratio: admitted p99 {r['admitted_p99_ms']:.1f} ms / unloaded p99 {r['unloaded_p99_ms']:.1f} ms = "
        f"{r['ratio']:.2f}x (target <= 2)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--max-queue", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--p99-ms", type=float, default=1000.0)
    ap.add_argument("--start-rate", type=float, default=20.0)
    ap.add_argument("--unloaded-rate", type=float, default=5.0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    r = overload(a.export, a.max_queue, a.max_batch, a.duration, a.p99_ms, a.start_rate, a.unloaded_rate,
                 a.max_new_tokens, say=lambda m: print(m, flush=True))
    report(r)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
