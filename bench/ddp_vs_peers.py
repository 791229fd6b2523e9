"""tandem's trainer against a hand-written torch DDP loop, Lightning Fabric and Accelerate: median step time.

    pip install -e .[bench]          # lightning, accelerate
    python bench/ddp_vs_peers.py [--world 2] [--steps 40] [--rounds 3] [--config examples/gpt_reverse.toml]

The same job spec (model, data set, DistributedSampler order, micro-batch, AdamW, threads per
worker) runs under each: ``tandem train`` (its step times from metrics.jsonl) and
bench/peers_worker.py under ``tandem launch`` (torchrun's environment) for the three peers. The
contestants are interleaved, round after round, so a machine's changing load falls on all of them
alike. Each run's median step time after its first 5 steps (warm-up); printed: the median over
rounds of each, and its ratio to the hand-written loop. Issue 15's target for tandem: at most 1.02,
and no slower than the fastest peer. On this shared 2-core VM, expect noise of several percent.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("torch", "tandem", "fabric", "accelerate")
WARMUP = 5


def overrides(a) -> dict:
    return {"schedule.max_steps": str(a.steps), "schedule.log_every": "1000", "checkpoint.at_end": "false",
            "launch.nproc_per_node": str(a.world), "launch.simulate_nodes": "0", "data.held_out": "0.01",
            "parallel.strategy": "ddp"}


def run_one(impl: str, a, d: Path, k: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run_dir = d / f"{impl}-{k}"
    ov = overrides(a)
    if impl == "tandem":
        cmd = [sys.executable, "-m", "tandem", "train", a.config, "--launch.run_dir", str(run_dir), "--fresh",
               *[x for kv in ov.items() for x in (f"--{kv[0]}", kv[1])]]
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=d)
        recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["step_time_s"] for r in recs if r.get("kind") == "step"]
    spec = d / "spec.json"
    spec.write_text(json.dumps({"config": a.config, "overrides": ov}))
    out = run_dir / "times.json"
    cmd = [sys.executable, "-m", "tandem", "launch", "--nproc-per-node", str(a.world), "--quiet",
           "--run-dir", str(run_dir), str(ROOT / "bench/peers_worker.py"), "--impl", impl, "--spec", str(spec),
           "--out", str(out)]
    # its own process group: a run that hangs (seen once with Fabric: one rank left, one waiting) is
    # ended whole after --run-timeout and reported, instead of stalling the bench
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=d,
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=a.run_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        print(f"{impl}: no result within {a.run_timeout} s (killed); logs were in {run_dir}/logs", flush=True)
        return []
    if p.returncode != 0:
        raise SystemExit(f"{impl} failed:\n{err[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", default=str(ROOT / "examples/gpt_reverse.toml"))
    ap.add_argument("--only", default=",".join(IMPLS))
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a peer's run is ended")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    impls = [i for i in IMPLS if i in a.only.split(",")]
    med: dict = {i: [] for i in impls}
    with tempfile.TemporaryDirectory() as d:
        for k in range(a.rounds):
            for impl in (impls if k % 2 == 0 else impls[::-1]):  # alternate the order too
                times = run_one(impl, a, Path(d), k)
                if times:
                    med[impl].append(statistics.median(times[WARMUP:] or times))
                    print(f"round {k + 1} {impl}: median step {med[impl][-1] * 1e3:.1f} ms", flush=True)
    base = statistics.median(med["torch"]) if med.get("torch") else None
    print(f"\n{a.world} workers, {a.steps} steps, {a.rounds} rounds; {a.config}")
    print(f"{'impl':<12}{'median step ms':>15}{'vs torch':>10}   per round (ms)")
    for impl, ms in med.items():
        if not ms:
            print(f"{impl:<12}{'no result':>15}")
            continue
        m = statistics.median(ms)
        ratio = f"{m / base:.3f}" if base else "-"
        print(f"{impl:<12}{m * 1e3:>15.1f}{ratio:>10}   " + " ".join(f"{x * 1e3:.1f}" for x in ms))
    if a.json:
        Path(a.json).write_text(json.dumps(med, indent=1))


if __name__ == "__main__":
    main()
