"""One worker of bench/ddp_vs_peers.py: the job spec's model, data, sampler and optimizer trained
by a hand-written torch DDP loop, Lightning Fabric or Hugging Face Accelerate (run under
``tandem launch``, i.e. torchrun's environment). Writes each step's wall time to ``--out`` (rank 0).

    tandem launch --nproc-per-node 2 --run-dir D bench/peers_worker.py --impl torch --spec s.json --out t.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("torch", "fabric", "accelerate"), required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from tandem.core.config import load_spec
    from tandem.core.validate import effective_lr
    from tandem.models import build_model
    from tandem.train import runtime as rt
    from tandem.train.data import load_datasets
    from tandem.train.tasks import IGNORE

    cfg = json.loads(Path(a.spec).read_text())
    spec = load_spec(cfg["config"], cfg["overrides"])
    s = spec.schedule
    rt.seed_everything(s.seed)
    model = build_model(spec.model)
    train_ds, _ = load_datasets(spec.data, s.seed, spec.model.num_classes, spec.model.in_channels, seq=spec.model.seq)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sampler = DistributedSampler(train_ds, world, rank, shuffle=spec.data.shuffle, seed=s.seed,
                                 drop_last=spec.data.remainder == "drop")
    loader = DataLoader(train_ds, batch_size=s.micro_batch, sampler=sampler, num_workers=spec.data.num_workers)
    o = spec.optim
    make_opt = lambda params: torch.optim.AdamW(params, lr=effective_lr(spec), betas=tuple(o.betas),  # noqa: E731
                                                weight_decay=o.weight_decay)

    def loss_of(out, y):  # tandem's: the sum over scored tokens / the step's scored tokens
        n = (y != IGNORE).sum().clamp(min=1)
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE) / n

    if a.impl == "torch":
        torch.distributed.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=spec.parallel.bucket_cap_mb,
                                                          gradient_as_bucket_view=True)
        opt = make_opt(model.parameters())
        backward = lambda loss: loss.backward()  # noqa: E731
    elif a.impl == "fabric":
        from lightning.fabric import Fabric
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=world // int(os.environ["LOCAL_WORLD_SIZE"]))
        fabric.launch()
        model, opt = fabric.setup(model, make_opt(model.parameters()))
        backward = fabric.backward
    else:
        from accelerate import Accelerator
        acc = Accelerator(cpu=True)
        model, opt = acc.prepare(model, make_opt(model.parameters()))
        backward = acc.backward

    times, step = [], 0
    model.train()
    epoch = 0
    while step < s.max_steps:
        sampler.set_epoch(epoch)
        it = iter(loader)
        while step < s.max_steps:
            t0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            loss = loss_of(model(x), y)
            backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            float(loss.detach())  # tandem reads the loss every step too
            times.append(time.perf_counter() - t0)
            step += 1
        epoch += 1
    if rank == 0:
        Path(a.out).write_text(json.dumps(times))
    rt.shutdown()  # fabric's and accelerate's groups too: a barrier, then destroy


if __name__ == "__main__":
    main()
