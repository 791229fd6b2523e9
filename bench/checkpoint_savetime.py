"""How long training blocks for a checkpoint: synchronous DCP save vs dcp.async_save.

    python bench/checkpoint_savetime.py [--width 64] [--repeats 3] [--dir /tmp/x]

One process (a gloo world of one), a ResNet-18 of the given width with SGD momentum
state, the same save path as the trainer (checkpoint.save: DCP, rng, meta, manifest,
atomic publish). The async case runs training steps while the save is in flight and
calls ``poll`` after each, as the trainer does, so every millisecond the training thread
spends in ``save`` or ``poll`` (staging copy, and publishing if that runs there) counts
as blocked. Prints medians (and ranges) of each mode, the async total, and the step time
with a save in flight against without (the writer and hasher share the cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from tandem.core.spec import ModelSpec  # noqa: E402
from tandem.models import build_model  # noqa: E402
from tandem.train import checkpoint as ckpt  # noqa: E402
from tandem.train.checkpoint_meta import CheckpointMeta  # noqa: E402
from tandem.train.runtime import DistContext  # noqa: E402


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(width: int = 64, repeats: int = 3, folder: Path | None = None, batch: int = 8) -> dict:
    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(tempfile.mktemp(prefix="tandem-savetime-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = build_model(ModelSpec(width=width, in_channels=1, num_classes=10, small_input=True))
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(batch, 1, 8, 8)

        def train_step() -> float:
            t = time.perf_counter()
            model(x).sum().backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            return time.perf_counter() - t

        train_step()
        ctx = DistContext(rank=0, world=1, local_rank=0, local_world=1, node=0, device=torch.device("cpu"),
                          backend="gloo")
        pg = dist.new_group(backend="gloo")
        base = Path(tempfile.mkdtemp(prefix="tandem-savetime-", dir=folder))  # fresh: saves never skip
        quiet = [train_step() for _ in range(5)]
        sync, block, stage, total, during, step = [], [], [], [], [], 0
        for _ in range(repeats):
            step += 1
            t0 = time.perf_counter()
            ckpt.save(base / "sync", step, model, optim, ctx, CheckpointMeta(step=step, epoch=0, world_size=1, model="resnet18"), keep_last=1)
            sync.append(time.perf_counter() - t0)
            quiet += [train_step() for _ in range(2)]
            t0 = time.perf_counter()
            pending = ckpt.save(base / "async", step, model, optim, ctx, CheckpointMeta(step=step, epoch=0, world_size=1, model="resnet18"), keep_last=1,
                                async_pg=pg)
            blocked = time.perf_counter() - t0
            stage.append(blocked)
            while True:
                during.append(train_step())
                t = time.perf_counter()
                path = pending.poll()
                blocked += time.perf_counter() - t
                if path is not None:
                    break
            block.append(blocked)
            total.append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in ckpt.latest(base / "sync").iterdir())
        assert ckpt.latest(base / "async").name == f"step-{step:08d}"
        return {"params": sum(p.numel() for p in model.parameters()), "checkpoint_mb": size / 2**20,
                "sync_block_s": _spread(sync), "async_block_s": _spread(block), "async_total_s": _spread(total),
                "async_stage_s": _spread(stage),
                "step_s": statistics.median(quiet), "step_during_save_s": statistics.median(during),
                "steps_during_save": len(during) / repeats}
    finally:
        if own:
            dist.destroy_process_group()


def _ms(s: dict) -> str:
    return f"{s['median'] * 1e3:8.1f} ms (range {s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    if a.width < 1 or a.repeats < 1:
        ap.error(f"--width and --repeats must be at least 1 (got {a.width}, {a.repeats})")
    r = measure(a.width, a.repeats, a.dir)
    print(f"resnet18 width {a.width}: {r['params'] / 1e6:.1f} M params, checkpoint {r['checkpoint_mb']:.0f} MiB, "
          f"{a.repeats} saves each")
    print(f"sync save:  training blocked {_ms(r['sync_block_s'])}")
    print(f"async save: training blocked {_ms(r['async_block_s'])}; written and published after "
          f"{r['async_total_s']['median'] * 1e3:.0f} ms")
    print(f"            of which in save (staging copy) {_ms(r['async_stage_s'])}, the rest in poll")
    print(f"training step {r['step_s'] * 1e3:.0f} ms alone, {r['step_during_save_s'] * 1e3:.0f} ms with the save "
          f"in flight ({r['steps_during_save']:.1f} steps per save)")


if __name__ == "__main__":
    main()
