"""Step time, bytes per step and final quality per parallel strategy on this machine (one run each).

    python bench/parallel_strategies.py [--steps 40] [--json out.json]

A 4-layer GPT (hidden 64, 4 heads, 2 kv heads, seq 16) learns the reverse task with SGD on gloo;
every strategy sees the same batches from the same initial weights. Columns: median step time
after the first step, bytes handed to collectives per step per rank (measured), final loss and
held-out token accuracy of the final weights, and the largest weight difference from ddp (exact
strategies should be ~1e-7; compression and local SGD trade accuracy for bytes).
On a 2-core CPU with 4 ranks the processes share cores: times compare the strategies' overheads
here, not what a GPU cluster would show.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the numerics harness lives with the tests
from harness.numerics import run_many, spawn  # noqa: E402
from tandem.core.spec import JobSpec  # noqa: E402
from tandem.models import build_model  # noqa: E402
from tandem.train.tasks import make_task, token_accuracy  # noqa: E402


OPT = {"name": "sgd", "lr": 0.3}


def job(strategy="ddp", tp=1, pp=1, **par) -> JobSpec:
    s = JobSpec()
    m = s.model
    m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.seq, m.vocab, m.tied = "gpt", 4, 64, 4, 2, 16, 16, pp == 1
    s.parallel.strategy, s.parallel.tp, s.parallel.pp = strategy, tp, pp
    for k, v in par.items():
        setattr(s.parallel, k, v)
    s.optim.name, s.optim.lr, s.optim.ref_batch, s.optim.weight_decay = OPT["name"], OPT["lr"], 0, 0.0
    s.schedule.global_batch, s.schedule.micro_batch = 32, 8
    return s


WORLD2 = {"ddp": {}, "zero1": dict(strategy="zero1"), "zero2": dict(strategy="zero2"),
          "zero3": dict(strategy="zero3"), "zero3+ac-full": dict(strategy="zero3", activation_checkpoint="full"),
          "tp2": dict(tp=2), "tp2+sp": dict(tp=2, sequence_parallel=True),
          "pp2-gpipe": dict(pp=2, pp_schedule="gpipe"), "pp2-1f1b": dict(pp=2),
          "pp2-interleaved": dict(pp=2, pp_schedule="interleaved"), "ddp+fp16": dict(comm_hook="fp16"),
          "ddp+powersgd-r2": dict(comm_hook="powersgd", powersgd_rank=2), "local-sgd-H4": dict(local_sgd_every=4),
          "post-local-sgd-H4-w10": dict(local_sgd_every=4, local_sgd_warmup=10)}
WORLD4 = {"hsdp-2x2": dict(strategy="hsdp"), "dp2xtp2-zero3": dict(strategy="zero3", tp=2),
          "dp2xpp2": dict(pp=2), "tp2xpp2": dict(tp=2, pp=2)}


def accuracy(spec, state) -> float:
    torch.manual_seed(0)
    m = build_model(spec.model)
    m.load_state_dict(state, strict=False)
    x, y = make_task("reverse", 512, spec.model.seq, 12345)
    with torch.no_grad():
        c, n = token_accuracy(m(x), y)
    return c / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default="")
    ap.add_argument("--optim", default="sgd", choices=["sgd", "adamw"])
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--only", default="", help="comma-separated strategy names (default: all)")
    a = ap.parse_args()
    OPT.update(name=a.optim, lr=a.lr)
    only = set(a.only.split(",")) if a.only else None
    os.environ["TANDEM_COUNT_COMM"] = "1"
    rows = []
    for world, cfgs in ((2, WORLD2), (4, WORLD4)):
        cfgs = {n: job(**kw) for n, kw in cfgs.items() if only is None or n in only}
        if not cfgs:
            continue
        res = spawn(run_many, world, cfgs, steps=a.steps, count=True, local_world=2)[0]
        for name, spec in cfgs.items():
            r = res[name]
            if "error" in r:
                print(f"{name}: {r['error'][-500:]}", file=sys.stderr)
                continue
            rows.append({"strategy": name, "layout": r["dims"], "step_ms": r["step_s"] * 1e3,
                         "bytes_per_step": sum(v["payload_bytes"] for v in r["comm"].values()),
                         "final_loss": r["losses"][-1], "accuracy": accuracy(spec, r["state"]), "state": r["state"]})
    ref = next(r for r in rows if r["strategy"] == "ddp")  # pp rows use untied embeddings: another model
    print(f"{'strategy':24s} {'layout':44s} {'step ms':>8s} {'KiB/step':>9s} {'loss':>7s} {'acc':>6s} "
          f"{'max|w-ddp|':>10s}")
    for r in rows:
        same = set(r["state"]) == set(ref["state"])
        diff = max((r["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"]) if same else float("nan")
        r["max_weight_diff_vs_ddp"] = diff
        print(f"{r['strategy']:24s} {r['layout']:44s} {r['step_ms']:8.1f} {r['bytes_per_step'] / 1024:9.1f} "
              f"{r['final_loss']:7.4f} {r['accuracy']:6.3f} {diff:10.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "state"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
