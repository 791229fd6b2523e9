"""How long training blocks for a checkpoint: synchronous DCP save vs dcp.async_save.

    python -m tandem.train.elastic.savetime [--width 64] [--repeats 3] [--dir /tmp/x]

One process (a gloo world of one), a ResNet-18 of the given width with SGD momentum
state, the same save path as the trainer (checkpoint.save: DCP, rng, meta, manifest,
atomic publish). Prints the median blocking time of each mode and the async total.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.core.spec import ModelSpec
from tandem.models import build_model
from tandem.train import checkpoint as ckpt
from tandem.train.runtime import DistContext


def measure(width: int = 64, repeats: int = 3, folder: Path | None = None) -> dict:
    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(tempfile.mktemp(prefix="tandem-savetime-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = build_model(ModelSpec(width=width, in_channels=1, num_classes=10, small_input=True))
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 1, 8, 8)).sum().backward()
        optim.step()
        ctx = DistContext(rank=0, world=1, local_rank=0, local_world=1, node=0, device=torch.device("cpu"),
                          backend="gloo")
        pg = dist.new_group(backend="gloo")
        base = Path(folder or tempfile.mkdtemp(prefix="tandem-savetime-"))
        sync, block, total, step = [], [], [], 0
        for _ in range(repeats):
            step += 1
            t0 = time.perf_counter()
            ckpt.save(base / "sync", step, model, optim, ctx, {"model": "resnet18"}, keep_last=1)
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pending = ckpt.save(base / "async", step, model, optim, ctx, {"model": "resnet18"}, keep_last=1,
                                async_pg=pg)
            block.append(time.perf_counter() - t0)
            pending.wait()
            total.append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in ckpt.latest(base / "sync").iterdir())
        return {"params": sum(p.numel() for p in model.parameters()), "checkpoint_mb": size / 2**20,
                "sync_block_s": statistics.median(sync), "async_block_s": statistics.median(block),
                "async_total_s": statistics.median(total)}
    finally:
        if own:
            dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    r = measure(a.width, a.repeats, a.dir)
    print(f"resnet18 width {a.width}: {r['params'] / 1e6:.1f} M params, checkpoint {r['checkpoint_mb']:.0f} MiB")
    print(f"sync save:  training blocked {r['sync_block_s'] * 1e3:8.1f} ms")
    print(f"async save: training blocked {r['async_block_s'] * 1e3:8.1f} ms "
          f"(written and published after {r['async_total_s'] * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
