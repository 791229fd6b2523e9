"""tandem's DDP training step against a hand-written torch DDP loop, measured in one run.

    python bench/ddp_overhead.py [--workers 2] [--steps 40] [--repeats 3] [--config examples/digits_resnet.toml]

Both loops run in the same worker processes, one after the other, repeated and
alternated (baseline, tandem, baseline, tandem, ...) so that drift on a shared
machine hits both. Same model, data, sampler, micro-batch, optimizer, precision and
memory format; the baseline is the loop from PyTorch's DDP tutorial. A step's time
is the wall time between the ends of consecutive steps (data loading, logging and
metrics included); each side's figure is the median after 5 warm-up steps, and the
ratio is tandem / baseline (target: at most 1.03). Rank 0's clock is the one read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 5


def baseline_steps(spec, ctx, steps: int) -> list[float]:
    """The plain loop a user writes from the DDP tutorial (no tandem code on the hot path)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from tandem.models import build_model
    from tandem.train.data import load_datasets

    torch.manual_seed(spec.schedule.seed)
    fmt = torch.channels_last if spec.model.channels_last and spec.precision.dtype != "fp32" else torch.contiguous_format
    model = build_model(spec.model).to(memory_format=fmt)
    model = DDP(model, bucket_cap_mb=spec.parallel.bucket_cap_mb, gradient_as_bucket_view=True)
    train, _ = load_datasets(spec.data, spec.schedule.seed, spec.model.num_classes, spec.model.in_channels)
    sampler = DistributedSampler(train, ctx.world, ctx.rank, seed=spec.schedule.seed)
    loader = DataLoader(train, batch_size=spec.schedule.micro_batch, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    dtype = torch.bfloat16 if spec.precision.dtype == "bf16" else None
    ends, epoch = [time.perf_counter()], 0
    while len(ends) <= steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.contiguous(memory_format=fmt)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            ends.append(time.perf_counter())
            if len(ends) > steps:
                break
        epoch += 1
    return [b - a for a, b in zip(ends, ends[1:])]


def tandem_steps(spec, ctx, steps: int, run_dir: Path) -> list[float]:
    from tandem.train import metrics
    from tandem.train.trainer import train

    s = dataclasses.replace(spec.schedule, max_steps=steps, epochs=100, global_batch=spec.schedule.micro_batch * ctx.world)
    ck = dataclasses.replace(spec.checkpoint, every_steps=0, at_end=False, resume="none")
    data = dataclasses.replace(spec.data, held_out=0.0)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True) if ctx.is_main else None
    train(dataclasses.replace(spec, schedule=s, checkpoint=ck, data=data), ctx, run_dir)
    # Wall time between consecutive step records: everything the loop does, logging included.
    ends = [r["time"] for r in metrics.read(run_dir) if r["kind"] == "step"]
    return [b - a for a, b in zip(ends, ends[1:])]


def worker(args) -> None:
    import torch.distributed as dist

    from tandem.core.config import load_spec
    from tandem.train import runtime as rt

    spec = load_spec(args.config, check=False)
    spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, held_out=0.0))
    ctx = rt.init()
    base, ours = [], []
    for rep in range(args.repeats):
        base += baseline_steps(spec, ctx, args.steps)[WARMUP:]
        dist.barrier()
        ours += tandem_steps(spec, ctx, args.steps, Path(args.out).parent / f"tandem-run-{rep}")[WARMUP:]
        dist.barrier()
    if ctx.is_main:
        Path(args.out).write_text(json.dumps({"baseline": base, "tandem": ours, "world": ctx.world}))
    rt.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default=str(ROOT / "examples" / "digits_resnet.toml"))
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "bench-ddp"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from tandem.core.spec import LaunchSpec
    from tandem.launch.launcher import launch

    run_dir = Path(args.run_dir)
    out = run_dir / "times.json"
    launch(LaunchSpec(nproc_per_node=args.workers), [__file__, "--worker", "--out", str(out), "--config", args.config,
                                                     "--steps", str(args.steps), "--repeats", str(args.repeats)],
           run_dir, quiet=True)
    res = json.loads(out.read_text())
    b, t = statistics.median(res["baseline"]), statistics.median(res["tandem"])
    print(f"workers {res['world']}, {len(res['baseline'])} measured steps per side")
    print(f"hand-written DDP loop : median step {b * 1e3:8.2f} ms")
    print(f"tandem trainer        : median step {t * 1e3:8.2f} ms")
    print(f"ratio tandem/baseline : {t / b:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
