"""GPU check of training (skipped without CUDA): `make gpu-check` runs this folder.

    make gpu-check          # python3 -m pytest tests/gpu -q -ra, PYTHONPATH=. (no venv: the GPU image's torch)

What it proves on one GPU, with NCCL:
- the GPT learns the reverse task in bf16 and in fp16 (GradScaler) under ddp and zero3;
- CUDA peak memory of a ~100M-parameter GPT step against `tandem plan`'s per-GPU prediction;
- `tandem bench train` measures a calibration on the GPU.

Each test appends its numbers to $TANDEM_GPU_REPORT (a JSON-lines file) when set, for the closing note.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tandem_testing import run_tandem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPT = """
name = "gpu-gpt"
[model]
name = "gpt"
layers = {layers}
hidden = {hidden}
heads = {heads}
kv_heads = {heads}
seq = {seq}
vocab = 16
[data]
name = "reverse"
num_samples = {samples}
held_out = 0.1
[optim]
name = "adamw"
lr = {lr}
ref_batch = 0
weight_decay = 0.0
[schedule]
global_batch = {batch}
micro_batch = {batch}
epochs = 1
max_steps = {steps}
warmup_steps = 10
log_every = 20
seed = 5
[precision]
dtype = "{dtype}"
[checkpoint]
every_steps = 0
at_end = false
[parallel]
strategy = "{strategy}"
[launch]
nproc_per_node = 1
device = "cuda"
backend = "nccl"
run_dir = "{run_dir}"
"""


def report(**row) -> None:
    print(json.dumps(row))
    path = os.environ.get("TANDEM_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def records(run, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind", r.get("event")) == kind]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_gpt_learns_on_cuda(tmp_path, strategy, dtype):
    run = tmp_path / "run"
    spec = tmp_path / "job.toml"
    spec.write_text(GPT.format(layers=2, hidden=128, heads=4, seq=16, samples=8192, lr=0.003, batch=64,
                               steps=300, dtype=dtype, strategy=strategy, run_dir=run))
    p = run_tandem("train", str(spec), timeout=420)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    steps = records(run, "step")
    start = records(run, "start")[0]
    assert start["backend"] == "nccl" and start["device"].startswith("cuda"), start
    first, last = steps[0]["loss"], steps[-1]["loss"]
    result = json.loads((run / "result.json").read_text())
    report(check="learns", strategy=strategy, dtype=dtype, loss_first=first, loss_last=last,
           accuracy=result.get("accuracy"), samples_per_s=result.get("samples_per_s"))
    assert all(s["loss"] == s["loss"] for s in steps), "a NaN loss"
    # the reverse task's answer tokens start near ln(16) = 2.77 nats; learning takes the mean well down
    assert last < 0.5 * first, (first, last)
    assert result["accuracy"] > 0.5, result


def test_cuda_peak_memory_against_the_plan(tmp_path):
    """One profiled step of a ~100M-parameter GPT (fp32 AdamW): the allocator's peak against the
    plan's params + grads + optimizer + activations (its 'other' is the CUDA context, not allocated),
    and per category from the step's CUDA memory snapshot, as tandem diagnose reads it."""
    run = tmp_path / "run"
    spec = tmp_path / "job.toml"
    spec.write_text(GPT.format(layers=8, hidden=1024, heads=16, seq=128, samples=512, lr=0.0003, batch=8,
                               steps=4, dtype="fp32", strategy="ddp", run_dir=run))
    p = run_tandem("train", str(spec), "--profile.enabled", "true", "--profile.start_step", "1",
                   "--profile.steps", "1", "--profile.memory", "true", timeout=420)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    meta = json.loads((run / "profile" / "rank-0" / "window.json").read_text())
    measured = meta["memory_peak_bytes"]["Total"]
    q = run_tandem("plan", "--config", str(spec), "--gpu", "h200", "--json")
    assert q.returncode == 0, q.stderr
    plan = json.loads(q.stdout)
    mem = plan["memory_per_gpu"]
    planned = mem["total"] - mem["other"]
    report(check="memory", params=plan["model"]["params"], measured_bytes=measured, planned_bytes=planned,
           ratio=measured / planned, plan_parts={k: mem[k] for k in ("params", "grads", "optimizer",
                                                                    "activations")},
           tracker=meta["memory_peak_bytes"])
    assert plan["model"]["params"] > 80e6
    assert 0.67 < measured / planned < 1.5, (measured, planned)
    # the CUDA memory snapshot's categories against the plan for the same spec (tandem diagnose)
    d = run_tandem("diagnose", str(run), "--json", timeout=300)
    assert d.returncode == 0, d.stderr[-3000:]
    vs = json.loads(d.stdout)["memory_vs_plan"]
    ratio = vs["ranks"]["0"]["ratio"]
    report(check="memory-snapshot", measured_mib=vs["ranks"]["0"]["measured_mib"], plan_mib=vs["plan"]["mib"],
           ratio=ratio, notes=vs["notes"])
    assert meta["memory_source"] == "cuda_snapshot", meta
    assert 0.95 < ratio["params"] < 1.05 and 0.95 < ratio["optimizer"] < 1.05, ratio
    assert 0 < ratio["grads"] < 1.1 and ratio["activations"] > 0, ratio


def test_bench_train_calibrates_on_the_gpu(tmp_path):
    out = tmp_path / "rows.json"
    p = run_tandem("bench", "train", "--workers", "1", "--steps", "20", "--precision", "bf16",
                   "--run-dir", str(tmp_path / "bench"), "--json", str(out), timeout=420)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())
    cal = json.loads((tmp_path / "bench" / "calibration.json").read_text())
    report(check="bench-train", rows=rows["rows"], calibration={k: cal.get(k) for k in (
        "device", "backend", "device_name", "nproc_per_node", "links", "compute")})
    assert cal["device"] == "cuda" and cal["backend"] == "nccl", cal
    # one GPU has no link to measure (NCCL takes one rank per GPU); two or more do
    assert bool(cal["links"]) == (torch.cuda.device_count() > 1), cal["links"]
    assert cal["compute"]["model"], cal["compute"]
