"""Are diagnose's verdicts right every time, how long does diagnose take, how big is the merged trace?

    PYTHONPATH=.:tests python bench/diagnose_repeat.py [--runs 5] [--world 2] [--window 8] [--run-dir runs/diag-repeat]

Per run: a fresh `tandem train` of the tiny digits job on ``--world`` gloo ranks with a profiled
window of ``--window`` steps and two faults injected through the existing knobs: the loader sleeps
40 ms a batch on every rank (`TANDEM_FAULTS=slow:...`) and rank 1's forward sleeps 80 ms
(tests/diagnose/slow_model.py). Then `tandem diagnose RUN --json --trace merged.json.gz`.

A run is right when diagnose says data-bound on every rank and names rank 1's forward as the one
straggler for its code (a rank the shared host starved of CPU is named with cause cpu-starved: the
host's doing, said as such, not counted against the answer). Printed per run: right or what was
said instead, diagnose's wall and CPU seconds (its own process), the merged trace's size; then
"right in K of N".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _right(rep: dict, world: int) -> tuple[bool, str]:
    data = [v for v in rep["verdicts"] if v["kind"] == "data-bound"]
    code = [(v["ranks"], v["section"]) for v in rep["verdicts"]
            if v["kind"] == "straggler" and v.get("cause") != "cpu-starved"]
    ok = bool(data) and data[0]["ranks"] == list(range(world)) and code == [([1], "forward")]
    return ok, "; ".join(v["title"] for v in rep["verdicts"]) or "no findings"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--run-dir", default="runs/diag-repeat")
    a = ap.parse_args()

    from tandem_testing import TINY

    tandem = [sys.executable, "-m", "tandem"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
           "TANDEM_FAULTS": ",".join(f"slow:rank={r}:ms=40" for r in range(a.world)),
           "SLOW_FORWARD_RANK": "1", "SLOW_FORWARD_MS": "80"}
    base = Path(a.run_dir)
    right = 0
    for i in range(a.runs):
        d = base / f"run-{i}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        spec = d / "job.toml"
        spec.write_text(TINY.format(model="diagnose.slow_model:factory", remainder="pad", global_batch=16 * a.world,
                                    micro_batch=16, max_steps=3 + a.window, dtype="fp32", every=0, keep=1,
                                    nproc=a.world, run_dir=str(d / "run")))
        p = subprocess.run(tandem + ["train", str(spec), "--profile.enabled", "true", "--profile.start_step", "3",
                                     "--profile.steps", str(a.window), "--checkpoint.at_end", "false"],
                           env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            print(f"run {i}: train failed (exit {p.returncode}): {p.stderr[-500:]}", flush=True)
            continue
        merged = d / "merged.json.gz"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        q = subprocess.run(tandem + ["diagnose", str(d / "run"), "--json", "--trace", str(merged)],
                           env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if q.returncode != 0:
            print(f"run {i}: diagnose failed: {q.stderr[-500:]}", flush=True)
            continue
        rep = json.loads(q.stdout)
        ok, said = _right(rep, a.world)
        right += ok
        print(f"run {i}: {'right' if ok else 'WRONG'} ({said}); diagnose {a.world} ranks x {len(rep['steps'])} "
              f"steps: {wall:.1f} s wall, {cpu:.1f} s CPU; merged trace {merged.stat().st_size / 1e6:.2f} MB; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"right in {right} of {a.runs} runs")


if __name__ == "__main__":
    main()
