"""The built-in trainer: data parallel training of a job spec, on the runtime's pieces.

One optimizer step = ``grad_accum`` micro-batches per rank; DDP all-reduces only on
the last one (``no_sync`` before). The loss of each micro-batch is a *sum* divided by
the samples of the whole step on this rank, so the gradient is the exact mean over
the step's samples even when the last step of an epoch is short.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tandem.core.spec import JobSpec
from tandem.core.validate import effective_lr, grad_accum
from tandem.models import build_model, model_signature
from tandem.train import checkpoint as ckpt
from tandem.train import runtime as rt
from tandem.train.data import load_datasets
from tandem.train.elastic import resume as el_resume
from tandem.train.elastic.hooks import ElasticHooks
from tandem.train.metrics import MetricsWriter
from tandem.train.sampler import ResumableDistributedSampler
from tandem.train.schedule import make_scheduler


def build_optimizer(spec: JobSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    o, lr = spec.optim, effective_lr(spec)
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=o.momentum, nesterov=o.nesterov,
                               weight_decay=o.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(o.betas), weight_decay=o.weight_decay)


def checkpoint_dir(spec: JobSpec, run_dir: Path) -> Path:
    return Path(spec.checkpoint.dir) if spec.checkpoint.dir else Path(run_dir) / "checkpoints"


def resume_path(spec: JobSpec, run_dir: Path) -> Path | None:
    own = el_resume.own_latest(checkpoint_dir(spec, run_dir))  # a restarted group: this run's newest
    if own is not None:
        return own
    r = spec.checkpoint.resume
    if r == "none":
        return None
    if r == "auto":
        return ckpt.latest(checkpoint_dir(spec, run_dir))
    return Path(r)


@torch.no_grad()
def evaluate(model, held, ctx: rt.DistContext, spec: JobSpec, fmt=torch.contiguous_format) -> tuple[int, int]:
    """Exact accuracy over the held-out set: rank r scores samples r, r+world, ... (no padding)."""
    rt.sync_buffers(model, ctx)
    model.eval()
    idx = list(range(ctx.rank, len(held), ctx.world))
    correct = 0
    for i in range(0, len(idx), 256):
        x, y = held[idx[i:i + 256]]
        with rt.autocast(ctx, spec.precision.dtype):
            x = x.to(ctx.device)
            pred = model(x.contiguous(memory_format=fmt) if x.dim() == 4 else x).argmax(1)
        correct += int((pred.cpu() == y).sum())
    model.train()
    c, t = rt.all_reduce_sum([correct, len(idx)], ctx)
    return int(c), int(t)


def train(spec: JobSpec, ctx: rt.DistContext, run_dir: Path) -> dict:
    s = spec.schedule
    rt.seed_everything(s.seed)  # same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = build_model(spec.model).to(ctx.device)
    signature = model_signature(model)
    if spec.model.sync_bn:
        model = rt.convert_sync_bn(model, ctx)
    nhwc = spec.model.channels_last and spec.precision.dtype != "fp32"
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    model = model.to(memory_format=fmt)
    train_ds, held = load_datasets(spec.data, s.seed, spec.model.num_classes, spec.model.in_channels)
    accum = grad_accum(spec, ctx.world)
    sampler = ResumableDistributedSampler(train_ds, ctx.world, ctx.rank, shuffle=spec.data.shuffle, seed=s.seed,
                                          drop_last=spec.data.remainder == "drop")
    per_step = s.micro_batch * accum  # samples per rank per optimizer step
    steps_per_epoch = -(-sampler.num_samples // per_step)
    total = min(s.max_steps, s.epochs * steps_per_epoch) if s.max_steps else s.epochs * steps_per_epoch

    ddp = rt.wrap_ddp(model, ctx, spec.parallel)
    optim = build_optimizer(spec, ddp)
    sched = make_scheduler(optim, total, s.warmup_steps, s.decay, s.min_lr_ratio)
    scaler = rt.grad_scaler(ctx, spec.precision.dtype)
    ckdir = checkpoint_dir(spec, run_dir)
    metrics = MetricsWriter(run_dir, ctx.is_main)
    log = print if ctx.is_main else (lambda *a, **k: None)
    el = ElasticHooks(spec, ctx, run_dir, metrics, log, ckdir)

    step, epoch, resumed = 0, 0, None
    if (path := resume_path(spec, run_dir)) is not None:
        meta = ckpt.read_meta(path)
        ckpt.check_compatible(meta, spec.model.name, signature, path)
        ckpt.load(path, ddp, optim, ctx)
        sched.load_state_dict(meta["scheduler"])
        step, epoch = meta["step"], meta["epoch"]
        position = el_resume.carry_position(meta, ctx.world, log)  # per rank, at this world size
        el.resumed(path, step)
        if position >= sampler.num_samples:
            epoch += 1
        else:
            sampler.set_epoch(epoch)
            sampler.set_start(position)
        resumed = str(path)
        log(f"resumed from {path} at step {step}, epoch {epoch}", flush=True)

    lr0 = effective_lr(spec)
    pad = sampler.padding
    metrics.write("start", world=ctx.world, nodes=ctx.world // ctx.local_world, global_batch=s.global_batch,
                  micro_batch=s.micro_batch, grad_accum=accum, effective_lr=lr0, base_lr=spec.optim.lr,
                  ref_batch=spec.optim.ref_batch, total_steps=total, steps_per_epoch=steps_per_epoch,
                  train_samples=len(train_ds), remainder=spec.data.remainder, padding=pad, resumed_from=resumed,
                  start_step=step, device=str(ctx.device), backend=ctx.backend, dtype=spec.precision.dtype)
    log(f"world {ctx.world} ({ctx.world // ctx.local_world} nodes x {ctx.local_world}) on {ctx.device}/{ctx.backend}"
        f" | global batch {s.global_batch} = {ctx.world} workers x micro {s.micro_batch} x accum {accum}"
        f" | effective lr {lr0:g} = {spec.optim.lr:g} x {s.global_batch}/{spec.optim.ref_batch or s.global_batch}"
        f" | {total} steps, {steps_per_epoch}/epoch | remainder {spec.data.remainder}: "
        f"{abs(pad)} sample(s) {'repeated' if pad >= 0 else 'left out'} per epoch", flush=True)

    accuracy, rates, t_start, last_saved = None, [], time.perf_counter(), None
    ddp.train()
    while step < total:
        sampler.set_epoch(epoch)
        consumed = sampler.start
        loader = iter(DataLoader(train_ds, batch_size=s.micro_batch, sampler=el.trace(sampler),
                                 num_workers=spec.data.num_workers))
        while step < total and consumed < sampler.num_samples:
            t0 = time.perf_counter()
            n_step = min(per_step, sampler.num_samples - consumed)  # samples of this step on this rank
            n_micro = -(-n_step // s.micro_batch)
            data_time, loss_sum = 0.0, 0.0
            for i in range(n_micro):
                td = time.perf_counter()
                x, y = next(loader)
                data_time += time.perf_counter() - td
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                if x.dim() == 4:
                    x = x.contiguous(memory_format=fmt)
                if i == n_micro - 1:
                    el.before_sync(step)
                    t_sync = time.perf_counter()
                with rt.no_sync(ddp, skip=i < n_micro - 1), rt.autocast(ctx, spec.precision.dtype):
                    loss = F.cross_entropy(ddp(x), y, reduction="sum") / n_step
                    (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.item()
            if scaler:
                scaler.step(optim)
                scaler.update()
            else:
                optim.step()
            optim.zero_grad(set_to_none=True)
            loss_sum = rt.all_reduce_sum([loss_sum], ctx)[0] / ctx.world  # the step's loss over all ranks
            lr = sched.get_last_lr()[0]
            sched.step()
            step += 1
            consumed += n_step
            dt = time.perf_counter() - t0
            rate = n_step * ctx.world / dt
            rates.append(rate)
            metrics.write("step", step=step, epoch=epoch, loss=loss_sum, lr=lr, samples_per_s=rate,
                          step_time_s=dt, data_time_s=data_time)
            el.on_step(step, epoch, dt, data_time, time.perf_counter() - t0 - (t_sync - t0))
            if step % s.log_every == 0 or step == total:
                log(f"step {step}/{total} epoch {epoch} loss {loss_sum:.4f} lr {lr:.4g} "
                    f"{rate:.0f} samples/s step {dt * 1e3:.1f} ms (data {data_time * 1e3:.1f} ms)", flush=True)
            every = spec.checkpoint.every_steps
            if (every and step % every == 0) or (step == total and spec.checkpoint.at_end):
                last_saved = _save(ckdir, step, epoch, consumed, ddp, optim, sched, ctx, spec, signature,
                                   metrics, el) or last_saved
        if consumed >= sampler.num_samples:
            if held is not None:
                c, t = evaluate(ddp, held, ctx, spec, fmt)
                accuracy = c / t
                metrics.write("eval", epoch=epoch, step=step, accuracy=accuracy, correct=c, total=t)
                log(f"epoch {epoch} held-out accuracy {accuracy:.4f} ({c}/{t})", flush=True)
            epoch += 1
    last_saved = el.finish() or last_saved
    wall = time.perf_counter() - t_start
    steady = rates[len(rates) // 5:] or rates  # the first steps pay for warm-up
    result = {"step": step, "epoch": epoch, "accuracy": accuracy, "world": ctx.world,
              "samples_per_s": sum(steady) / len(steady) if steady else None, "wall_s": wall,
              "checkpoint": str(last_saved) if last_saved else None, "global_batch": s.global_batch,
              "effective_lr": lr0, "grad_accum": accum}
    result.update(el.summary())
    metrics.write("end", **result)
    metrics.close()
    return result


def _save(ckdir, step, epoch, consumed, ddp, optim, sched, ctx, spec, signature, metrics, el):
    t0 = time.perf_counter()
    meta = {"epoch": epoch, "consumed": consumed, "scheduler": sched.state_dict(), "model": spec.model.name,
            "signature": signature, "job": spec.name}
    path = el.save(ckdir, step, ddp, optim, meta)
    if path is not None:
        metrics.write("ckpt", step=step, path=str(path), save_s=time.perf_counter() - t0)
    return path
