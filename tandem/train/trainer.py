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
from tandem.core.validate import effective_lr
from tandem.models import model_signature
from tandem.train import checkpoint as ckpt
from tandem.train import runtime as rt
from tandem.train.data import load_datasets
from tandem.train.elastic import resume as el_resume
from tandem.train.elastic.resume import checkpoint_dir, layout_of, resume_path, schedule_key
from tandem.train.elastic.hooks import ElasticHooks
from tandem.train.metrics import MetricsWriter
from tandem.train.parallel import build_optimizer as par_optimizer
from tandem.train.parallel import parallelize
from tandem.train.parallel.ddp import prime_buckets
from tandem.train.parallel.materialize import Materializer, build_meta
from tandem.train.peak_memory import PeakMemory
from tandem.train.profile import StepProfiler
from tandem.train.sampler import ResumableDistributedSampler
from tandem.train.schedule import make_scheduler


def build_optimizer(spec: JobSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    o, lr = spec.optim, effective_lr(spec)
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=o.momentum, nesterov=o.nesterov,
                               weight_decay=o.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(o.betas), weight_decay=o.weight_decay)


@torch.no_grad()
def evaluate(model, held, ctx: rt.DistContext, spec: JobSpec, fmt=torch.contiguous_format,
             par=None) -> tuple[int, int]:
    """Exact accuracy over the held-out set: rank r scores samples r, r+world, ... (no padding).

    Under pp (``par`` with a schedule) the stages run forward only, hidden states sent stage to
    stage, and the rank holding the last stage (tp coordinate 0) scores its data rank's samples."""
    pipelined = par is not None and par.schedule is not None
    if not pipelined:  # pp: the stages' skeletons differ (and the GPT has no buffers)
        rt.sync_buffers(model, ctx)
    model.eval()
    dp = getattr(model, "_tandem_dp", None)
    rank, world = (model._tandem_dp_rank, dp) if dp else (ctx.rank, ctx.world)
    # the stages (and tp ranks) of one pipeline share a data rank: the same batches, so sends pair up
    idx = list(range(rank, len(held), world))
    correct, scored = 0, 0
    for i in range(0, len(idx), 256):
        x, y = held[idx[i:i + 256]]
        with rt.autocast(ctx, spec.precision.dtype):
            x = x.to(ctx.device)
            x = x.contiguous(memory_format=fmt) if x.dim() == 4 else x
            out = _pp_forward(par, x) if pipelined else model(x)
        if out is None:
            continue  # pp: not the last stage
        out = out.full_tensor() if hasattr(out, "full_tensor") else out  # tp: logits sharded over the vocab
        if pipelined and par.coords["tp"] != 0:
            continue  # a tp replica of the rank that scores
        if y.dim() == 2:  # sequence task: token accuracy over the scored positions
            from tandem.train.tasks import token_accuracy
            c_i, n_i = token_accuracy(out.cpu(), y)
            correct, scored = correct + c_i, scored + n_i
        else:
            correct, scored = correct + int((out.argmax(1).cpu() == y).sum()), scored + len(y)
    model.train()
    # tp ranks score the same samples: count them once (under pp only one rank per replica scored)
    rep_ = 1 if pipelined else getattr(model, "_tandem_replicas", 1)
    c, t = rt.all_reduce_sum([correct / rep_, scored / rep_], ctx)
    return round(c), round(t)


def _pp_forward(par, x):
    from tandem.train.parallel.pp import forward_only
    return forward_only(par, x)


def train(spec: JobSpec, ctx: rt.DistContext, run_dir: Path) -> dict:
    s = spec.schedule
    mem = PeakMemory(ctx.device)  # the baseline before the build: the run's peak memory per rank, in the end record
    rt.seed_everything(s.seed)  # same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = build_meta(spec.model, ctx.device)  # meta: parallelize materializes this rank's shards only
    signature = model_signature(model)
    if spec.model.sync_bn:
        model = rt.convert_sync_bn(model, ctx)
    nhwc = spec.model.channels_last and spec.precision.dtype != "fp32"
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    model = model.to(memory_format=fmt)
    train_ds, held = load_datasets(spec.data, s.seed, spec.model.num_classes, spec.model.in_channels,
                                   seq=spec.model.seq)
    log = print if ctx.is_main else (lambda *a, **k: None)
    par = parallelize(model, spec, ctx, log, Materializer(s.seed, ctx.device))  # tp, pp, checkpointing, compile, dp sharding (docs/parallel.md)
    dp_world, dp_rank = par.dp, par.dp_rank   # data ranks: tp and pp ranks of one replica read the same batch
    el_resume.agree_attempt(ctx)  # one attempt number for the group, a node that just joined included
    path = resume_path(spec, run_dir)
    meta = ckpt.read_meta(path) if path is not None else None
    rz = el_resume.plan_resize(spec, meta, dp_world)  # elastic.on_resize: the batch at this world size
    accum = rz.accum
    sampler = ResumableDistributedSampler(train_ds, dp_world, dp_rank, shuffle=spec.data.shuffle, seed=s.seed,
                                          drop_last=spec.data.remainder == "drop")
    y0 = train_ds[0][1]
    per_sample = int((y0 != -100).sum()) if y0.dim() else 1  # scored targets per sample (tokens for gpt tasks)
    per_step = s.micro_batch * accum  # samples per rank per optimizer step
    epoch_len = sampler.num_samples  # samples per rank per epoch
    if par.schedule is not None:  # pipeline stages keep static shapes: whole steps only, the tail is left out
        epoch_len -= epoch_len % per_step
    steps_per_epoch = -(-epoch_len // per_step)
    total = min(s.max_steps, s.epochs * steps_per_epoch) if s.max_steps else s.epochs * steps_per_epoch

    ddp = par.model
    ddp._tandem_dp, ddp._tandem_dp_rank, ddp._tandem_replicas = dp_world, dp_rank, ctx.world // dp_world
    ddp._tandem_accum = accum
    optim = par_optimizer(spec, par, effective_lr(spec), build_optimizer)
    sched = make_scheduler(optim, total, s.warmup_steps, s.decay, s.min_lr_ratio)
    scaler = rt.grad_scaler(ctx, spec.precision.dtype)
    ckdir = checkpoint_dir(spec, run_dir)
    metrics = MetricsWriter(run_dir, ctx.is_main)
    el = ElasticHooks(spec, ctx, run_dir, metrics, log, ckdir)
    prof = StepProfiler(spec.profile, ctx, run_dir)  # [profile]: a window of steps, phases named
    par.phase = prof.phase
    prof.track(ddp, optim)

    step, epoch, resumed = 0, 0, None
    if path is not None:
        ckpt.check_compatible(meta, spec.model.name, signature, path)
        prime_buckets(par, train_ds, s.micro_batch, fmt, ctx.device, rt.autocast(ctx, spec.precision.dtype))
        ckpt.load(path, ddp, optim, ctx)
        sched.load_state_dict(meta["scheduler"])
        for group, lr in zip(optim.param_groups, sched.get_last_lr()):  # zero1's wrapper groups: not in DCP's state
            group["lr"] = lr
        step, epoch = meta["step"], meta["epoch"]
        old = {**meta, "world_size": meta.get("data_world", meta.get("world_size"))}
        position = el_resume.carry_position(old, dp_world, log)  # per data rank, at this dp size
        el.resumed(path, step)
        if position >= epoch_len:
            epoch, position = epoch + 1, 0
        else:
            sampler.set_epoch(epoch)
            sampler.set_start(position)
        resumed = str(path)
        log(f"resumed from {path} at step {step}, epoch {epoch}", flush=True)
        old_ratio = sched.ratio
        if rz.ratio != 1 or old_ratio != 1:  # a global batch off the configured one: the schedule follows it
            total = step + el_resume.steps_left(spec, epoch, position, epoch_len, per_step, steps_per_epoch,
                                                sched.position(step), rz.ratio)
            sched.resize(step, rz.ratio, total - step)
        if rz.changed:
            peak = effective_lr(spec)
            log(el_resume.describe_resize(rz, s.micro_batch, step, peak * old_ratio, peak * rz.ratio,
                                          sched.get_last_lr()[0], sched.position(step), sched.horizon,
                                          total - step), flush=True)
            metrics.write("resize", step=step, **rz.record(), peak_lr_before=peak * old_ratio,
                          peak_lr_after=peak * rz.ratio, lr_now=sched.get_last_lr()[0],
                          schedule_position=sched.position(step), schedule_horizon=sched.horizon,
                          total_steps=total)

    lr0 = effective_lr(spec) * rz.ratio
    scaled = f" x {rz.global_batch}/{s.global_batch} (on_resize scale_lr)" if rz.ratio != 1 else ""
    pad = sampler.padding
    metrics.write("start", world=ctx.world, nodes=ctx.world // ctx.local_world, global_batch=rz.global_batch,
                  micro_batch=s.micro_batch, grad_accum=accum, effective_lr=lr0, on_resize=rz.mode,
                  lr_scale=rz.ratio, base_lr=spec.optim.lr,
                  ref_batch=spec.optim.ref_batch, total_steps=total, steps_per_epoch=steps_per_epoch,
                  train_samples=len(train_ds), remainder=spec.data.remainder, padding=pad, resumed_from=resumed,
                  start_step=step, device=str(ctx.device), backend=ctx.backend, dtype=spec.precision.dtype,
                  parallel=par.dims.describe(), pipeline_split=par.split)
    log(f"world {ctx.world} ({ctx.world // ctx.local_world} nodes x {ctx.local_world}) on {ctx.device}/{ctx.backend}"
        f" | {par.dims.describe()}"
        f" | global batch {rz.global_batch} = {dp_world} data ranks x micro {s.micro_batch} x accum {accum}"
        f" | effective lr {lr0:g} = {spec.optim.lr:g} x {s.global_batch}/{spec.optim.ref_batch or s.global_batch}"
        f"{scaled}"
        f" | {total} steps, {steps_per_epoch}/epoch | remainder {spec.data.remainder}: "
        f"{abs(pad)} sample(s) {'repeated' if pad >= 0 else 'left out'} per epoch", flush=True)

    accuracy, rates, t_start, last_saved, scored_at = None, [], time.perf_counter(), None, None

    def score(epoch: int, step: int) -> float:
        el.pause("eval")  # the hang watchdog judges training steps, not evaluation
        prof.end_memory()
        c, t = evaluate(ddp, held, ctx, spec, fmt, par)
        metrics.write("eval", epoch=epoch, step=step, accuracy=c / t, correct=c, total=t)
        log(f"epoch {epoch} held-out accuracy {c / t:.4f} ({c}/{t})", flush=True)
        return c / t

    records = _StepRecords(metrics, log, s.log_every, total, dp_world)
    carry = 0.0  # a SIGTERM flag read when an epoch's records were flushed, for the next step
    ddp.train()
    while step < total:
        sampler.set_epoch(epoch)
        consumed = sampler.start
        loader = iter(DataLoader(train_ds, batch_size=s.micro_batch, sampler=el.trace(sampler),
                                 num_workers=spec.data.num_workers))
        while step < total and consumed < epoch_len:
            prof.step(step)
            t0 = time.perf_counter()
            n_step = min(per_step, epoch_len - consumed)  # samples of this step on this rank
            n_micro = -(-n_step // s.micro_batch)
            data_time, loss_sum, batch = 0.0, 0.0, []
            for i in range(n_micro):
                td = time.perf_counter()
                with prof.phase("data"):
                    x, y = next(loader)
                data_time += time.perf_counter() - td
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                if x.dim() == 4:
                    x = x.contiguous(memory_format=fmt)
                if i == n_micro - 1:
                    el.before_sync(step)
                    t_sync = time.perf_counter()
                if par.schedule is not None:  # pipeline: the schedule runs the step's micro-batches at once
                    batch.append((x, y))
                    if i == n_micro - 1:
                        x, y = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])
                        with prof.phase("forward_backward"):
                            loss_sum = par.forward_backward(x, y, n_step * per_sample,
                                                            rt.autocast(ctx, spec.precision.dtype), False)
                    continue
                if y.dim() == 2 or par.loss_parallel or scaler is None:
                    loss_sum += par.forward_backward(x, y, n_step * per_sample,
                                                     rt.autocast(ctx, spec.precision.dtype), i < n_micro - 1)
                    continue
                with rt.no_sync(ddp, skip=i < n_micro - 1), rt.autocast(ctx, spec.precision.dtype):
                    with prof.phase("forward"):
                        loss = F.cross_entropy(ddp(x), y, reduction="sum") / n_step
                    with prof.phase("backward"):
                        (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.item()
            with prof.phase("sync"):
                par.finish_backward()  # tp/pp with dp: the gradient all-reduce DDP would have done
            with prof.phase("optimizer"):
                if scaler:
                    scaler.step(optim)
                    scaler.update()
                else:
                    optim.step()
                optim.zero_grad(set_to_none=True)
            with prof.phase("sync"):
                par.after_step()  # local SGD: average the models every H steps
            scored = loss_sum if par.has_last and par.coords["tp"] == 0 else 0.0  # one copy per replica
            # the step's loss over all replicas, read next step; with it, how many ranks got a SIGTERM
            with prof.phase("sync"):
                loss_all = rt.PendingSum([scored, el.stop.flag], ctx)
            lr = sched.get_last_lr()[0]
            sched.step()
            step += 1
            consumed += n_step
            dt = time.perf_counter() - t0
            rate = n_step * dp_world / dt
            rates.append(rate)
            stop_flag = carry + records.add(loss_all, step=step, epoch=epoch, lr=lr, samples_per_s=rate,
                                            step_time_s=dt, data_time_s=data_time, time=time.time())
            carry = 0.0  # the previous step's sum (and one read at the end of the last epoch)
            el.on_step(step, epoch, dt, data_time, time.perf_counter() - t0 - (t_sync - t0))
            every = spec.checkpoint.every_steps
            periodic = (every and step % every == 0) or (step == total and spec.checkpoint.at_end)
            if periodic:
                stop_flag += records.flush()
            stop = step < total and el.stop_here(stop_flag, step, periodic)  # SIGTERM: every rank stops here
            if periodic or stop:
                records.flush()
                with prof.phase("checkpoint"):
                    last_saved = _save(ckdir, step, epoch, consumed, ddp, optim, sched, ctx, spec, signature,
                                       metrics, el, total) or last_saved
            if stop:
                raise el.stopped(step, last_saved)
        carry = records.flush()
        if consumed >= epoch_len:
            if held is not None:
                accuracy, scored_at = score(epoch, step), step
            epoch += 1
    if held is not None and scored_at != step:  # max_steps ended the run inside an epoch: score its weights
        accuracy = score(epoch, step)
    prof.close()
    last_saved = el.finish() or last_saved
    wall = time.perf_counter() - t_start
    steady = rates[len(rates) // 5:] or rates  # the first steps pay for warm-up
    result = {"step": step, "epoch": epoch, "accuracy": accuracy, "world": ctx.world,
              "samples_per_s": sum(steady) / len(steady) if steady else None, "wall_s": wall,
              "checkpoint": str(last_saved) if last_saved else None, "global_batch": rz.global_batch,
              "effective_lr": lr0, "grad_accum": accum, "parallel": par.dims.describe()}
    result.update(el.summary())
    result["memory"] = mem.gather(ctx)  # collective
    metrics.write("end", **result)
    metrics.close()
    return result


class _StepRecords:
    """A step's record (and log line) waits for the next step, which hides its loss all-reduce."""

    def __init__(self, metrics: MetricsWriter, log, every: int, total: int, dp_world: int) -> None:
        self.metrics, self.log, self.every, self.total, self.dp_world = metrics, log, every, total, dp_world
        self.pending = None

    def add(self, loss: rt.PendingSum, **rec) -> float:
        """Queue this step's record; returns the previous step's other sums (the stop flag)."""
        flag = self.flush()
        self.pending = (loss, rec)
        return flag

    def flush(self) -> float:
        if self.pending is None:
            return 0.0
        (loss, r), self.pending = self.pending, None
        total, flag = loss.result()
        r = {"step": r.pop("step"), "epoch": r.pop("epoch"), "loss": total / self.dp_world, **r}
        self.metrics.write("step", **r)
        if r["step"] % self.every == 0 or r["step"] == self.total:
            self.log(f"step {r['step']}/{self.total} epoch {r['epoch']} loss {r['loss']:.4f} lr {r['lr']:.4g} "
                     f"{r['samples_per_s']:.0f} samples/s step {r['step_time_s'] * 1e3:.1f} ms "
                     f"(data {r['data_time_s'] * 1e3:.1f} ms)", flush=True)
        return flag


def _save(ckdir, step, epoch, consumed, ddp, optim, sched, ctx, spec, signature, metrics, el, total):
    t0 = time.perf_counter()
    meta = {"epoch": epoch, "consumed": consumed, "scheduler": sched.state_dict(), "model": spec.model.name,
            "signature": signature, "job": spec.name, "data_world": getattr(ddp, "_tandem_dp", ctx.world),
            "grad_accum": ddp._tandem_accum, "global_batch": getattr(ddp, "_tandem_dp", ctx.world) *
            spec.schedule.micro_batch * ddp._tandem_accum,
            "parallel": layout_of(spec), "total_steps": total, "schedule_key": schedule_key(spec)}
    path = el.save(ckdir, step, ddp, optim, meta)
    if path is not None:
        metrics.write("ckpt", step=step, path=str(path), save_s=time.perf_counter() - t0)
    return path
