"""The built-in trainer, in three parts (torchtitan's shape):

- ``setup``: model, data, ``parallelize``, optimizer, scheduler, the run's sizes (``Job``) and where
  it stands (``TrainState``, restored from the checkpoint it resumes);
- the step (tandem/train/step.py): ``forward_backward_step`` and ``train_step``, one path for every
  strategy;
- ``train``: the loop over epochs and steps: records, the agreed stop, checkpoints, evaluation.

One optimizer step = ``grad_accum`` micro-batches per rank; the data-parallel sync runs only on
the last one. The loss of each micro-batch is a *sum* divided by the scored targets of the whole
step on this rank, so the gradient is the exact mean over the step's samples even when the last
step of an epoch is short (tandem/train/loss.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import DataLoader

from tandem.core.contract import run_id
from tandem.core.spec import JobSpec
from tandem.core.steps import rank_epoch_len, total_steps
from tandem.core.steps import steps_per_epoch as count_steps_per_epoch
from tandem.core.validate import effective_lr
from tandem.data.tokens import held_out_summary
from tandem.models import model_signature
from tandem.models.output import logits_of
from tandem.train import checkpoint as ckpt
from tandem.train import runtime as rt
from tandem.train.checkpoint_meta import CheckpointMeta, input_record
from tandem.train.data import load_datasets
from tandem.train.elastic import resume as el_resume
from tandem.train.elastic.resume import checkpoint_dir, layout_of, resume_path, schedule_key
from tandem.train.elastic.fault_tolerance import FaultTolerance
from tandem.train.metrics import MetricsWriter, training_rate
from tandem.train.loss import resolve_loss
from tandem.train.optim import build_optimizer
from tandem.train.parallel import Parallel, loss_sum, parallelize
from tandem.train.parallel.ddp import prime_buckets
from tandem.train.parallel.expert import step_record
from tandem.models.hf import weights_for
from tandem.train.parallel.materialize import Materializer, build_meta
from tandem.train.peak_memory import PeakMemory
from tandem.train.profile import StepProfiler
from tandem.train.sampler import ResumableDistributedSampler
from tandem.train.schedule import make_scheduler
from tandem.train.step import Stepper, TrainState


@torch.no_grad()
def evaluate(model, held, ctx: rt.DistContext, spec: JobSpec, fmt=torch.contiguous_format,
             par=None, stats: dict | None = None) -> tuple[int, int]:
    """Exact accuracy over the held-out set: rank r scores samples r, r+world, ... (no padding).
    ``stats``, if given, gets ``nll``: the summed cross-entropy of the scored targets (all ranks).

    Under pp (``par`` with a schedule) the stages run forward only, hidden states sent stage to
    stage, and the rank holding the last stage (tp coordinate 0) scores its data rank's samples."""
    pipelined = par is not None and par.schedule is not None
    if not pipelined:  # pp: the stages' skeletons differ (and the GPT has no buffers)
        rt.sync_buffers(model, ctx)
    model.eval()
    rank, world = (par.dp_rank, par.dp) if par is not None else (ctx.rank, ctx.world)
    # the stages (and tp ranks) of one pipeline share a data rank: the same batches, so sends pair up
    idx = list(range(rank, len(held), world))
    correct, scored, nll = 0, 0, 0.0
    # ep: each forward joins the experts' all-to-alls, so every rank runs as many (a short share idles on its first)
    stop = par.ep.most(len(idx), ctx.device) if par is not None and par.ep is not None else len(idx)
    for i in range(0, stop, 256):
        x, y = held[idx[i:i + 256] or idx[:1] or [0]]
        with rt.autocast(ctx, spec.precision.dtype):
            x = x.to(ctx.device)
            x = x.contiguous(memory_format=fmt) if x.dim() == 4 else x
            out = _pp_forward(par, x) if pipelined else logits_of(model(x))
        if out is None or i >= len(idx):
            continue  # pp: not the last stage; ep: a forward for the peers only
        out = out.full_tensor() if hasattr(out, "full_tensor") else out  # tp: logits sharded over the vocab
        if pipelined and par.coords["tp"] != 0:
            continue  # a tp replica of the rank that scores
        if y.dim() == 2:  # sequence task: token accuracy over the scored positions
            from tandem.train.tasks import token_accuracy
            c_i, n_i = token_accuracy(out.cpu(), y)
            correct, scored = correct + c_i, scored + n_i
        else:
            correct, scored = correct + int((out.argmax(1).cpu() == y).sum()), scored + len(y)
        if stats is not None:
            nll += float(loss_sum(out.float().cpu(), y))
    model.train()
    # tp ranks score the same samples: count them once (under pp only one rank per replica scored)
    rep_ = 1 if pipelined or par is None else ctx.world // par.dp
    c, t, n = rt.all_reduce_sum([correct / rep_, scored / rep_, nll / rep_], ctx)
    if stats is not None:
        stats["nll"] = n
    return round(c), round(t)


def _pp_forward(par, x):
    from tandem.train.parallel.pp import forward_only
    return forward_only(par, x)


@dataclass(frozen=True, kw_only=True)
class Counts:
    """The run's numbers at this world size (elastic.on_resize's batch arithmetic applied)."""

    accum: int            # micro-batches per rank per optimizer step
    per_step: int         # samples per rank per optimizer step
    per_sample: int       # scored targets per sample (tokens for the gpt tasks)
    epoch_len: int        # samples per rank per epoch
    steps_per_epoch: int
    total: int            # optimizer steps of the whole run
    global_batch: int
    lr0: float            # the effective peak LR at this world size


@dataclass(frozen=True, kw_only=True)
class Data:
    """What the steps and the evaluation read."""

    train_ds: object
    held: object          # the held-out set (None: none)
    sampler: ResumableDistributedSampler
    fmt: torch.memory_format  # of the image batches (and the model): channels_last under autocast


@dataclass(frozen=True, kw_only=True)
class Outputs:
    """Where the run leaves what it did."""

    metrics: MetricsWriter
    ckdir: Path
    prof: StepProfiler
    mem: PeakMemory       # the run's peak memory per rank (measured from before the build)


@dataclass(kw_only=True)
class Job:
    """What the loop works with, built once by ``setup`` (``counts`` replaced when a resume resizes the run)."""

    spec: JobSpec
    ctx: rt.DistContext
    par: Parallel
    stepper: Stepper
    optim: torch.optim.Optimizer
    sched: object
    signature: dict
    el: FaultTolerance
    log: Callable
    data: Data
    out: Outputs
    counts: Counts


def train(spec: JobSpec, ctx: rt.DistContext, run_dir: Path) -> dict:
    job, st = setup(spec, ctx, run_dir)
    t_start = time.perf_counter()
    records = _StepRecords(job.out.metrics, job.log, spec.schedule.log_every, job.counts.total, job.par.dp)
    vote = _StopVote(ctx)
    job.par.model.train()
    while st.step < job.counts.total:
        job.data.sampler.set_epoch(st.epoch)
        st.consumed = job.data.sampler.start
        loader = iter(DataLoader(job.data.train_ds, batch_size=spec.schedule.micro_batch,
                                 sampler=job.el.trace(job.data.sampler), num_workers=spec.data.num_workers))
        while st.step < job.counts.total and st.consumed < job.counts.epoch_len:
            _step(job, st, loader, records, vote)
        records.flush()
        if st.consumed >= job.counts.epoch_len:
            if job.data.held is not None:
                st.accuracy, st.scored_at = _score(job, st), st.step
            st.epoch += 1
    if job.data.held is not None and st.scored_at != st.step:  # max_steps ended the run inside an epoch
        st.accuracy = _score(job, st)
    return _finish(job, st, time.perf_counter() - t_start)


def setup(spec: JobSpec, ctx: rt.DistContext, run_dir: Path) -> tuple[Job, TrainState]:
    """Everything the loop needs, and where the run stands (its checkpoint's state when it resumes)."""
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
    weights = weights_for(spec.model)  # model.name = "hf:DIR": shards filled from the checkpoint, not the init
    par = parallelize(model, spec, ctx, log, Materializer(s.seed, ctx.device, weights))  # tp, pp, checkpointing, compile, dp sharding (docs/parallel.md)
    dp_world, dp_rank = par.dp, par.dp_rank   # data ranks: tp and pp ranks of one replica read the same batch
    el_resume.agree_attempt(ctx)  # one attempt number for the group, a node that just joined included
    path = resume_path(spec, run_dir)
    meta = ckpt.read_meta(path) if path is not None else None
    rz = el_resume.plan_resize(spec, meta, dp_world)  # elastic.on_resize: the batch at this world size
    sampler = ResumableDistributedSampler(train_ds, dp_world, dp_rank, shuffle=spec.data.shuffle, seed=s.seed,
                                          drop_last=spec.data.remainder == "drop")
    y0 = train_ds[0][1]
    per_step = s.micro_batch * rz.accum
    # pipeline stages keep static shapes: whole steps only, the tail is left out (the count plan --config shows)
    epoch_len = rank_epoch_len(len(train_ds), dp_world, spec.data.remainder == "drop", per_step,
                               whole_steps=par.schedule is not None)
    steps_per_epoch = count_steps_per_epoch(epoch_len, per_step)
    total = total_steps(s.epochs, steps_per_epoch, s.max_steps)
    optim = build_optimizer(spec, par)
    sched = make_scheduler(optim, total, s.warmup_steps, s.decay, s.min_lr_ratio)
    metrics = MetricsWriter(run_dir, ctx.is_main)
    ckdir = checkpoint_dir(spec, run_dir)
    prof = StepProfiler(spec.profile, ctx, run_dir)  # [profile]: a window of steps, phases named
    prof.track(par.model, optim)
    stepper = Stepper(par, optim, spec, ctx, resolve_loss(spec.model.loss), prof.phase)
    el = FaultTolerance(spec, ctx, run_dir, metrics, log, ckdir)
    counts = Counts(accum=rz.accum, per_step=per_step, per_sample=int((y0 != -100).sum()) if y0.dim() else 1,
                    epoch_len=epoch_len, steps_per_epoch=steps_per_epoch, total=total, global_batch=rz.global_batch,
                    lr0=effective_lr(spec) * rz.ratio)
    job = Job(spec=spec, ctx=ctx, par=par, stepper=stepper, optim=optim, sched=sched, signature=signature, el=el,
              log=log, data=Data(train_ds=train_ds, held=held, sampler=sampler, fmt=fmt),
              out=Outputs(metrics=metrics, ckdir=ckdir, prof=prof, mem=mem), counts=counts)
    st = TrainState()
    if path is not None:
        _resume(job, st, path, meta, rz)
    _announce(job, st, rz, path)
    return job, st


def _resume(job: Job, st: TrainState, path: Path, meta: CheckpointMeta, rz) -> None:
    spec, s, sched, log = job.spec, job.spec.schedule, job.sched, job.log
    ckpt.check_compatible(meta, spec.model.name, job.signature, path)
    prime_buckets(job.stepper, job.data.train_ds, s.micro_batch, job.data.fmt, job.ctx.device)
    ckpt.load(path, job.par.model, job.optim, job.ctx)
    sched.load_state_dict(meta.scheduler)
    for group, lr in zip(job.optim.param_groups, sched.get_last_lr()):  # zero1's wrapper groups: not in DCP's state
        group["lr"] = lr
    if job.stepper.scaler is not None and meta.grad_scaler is not None:
        job.stepper.scaler.load_state_dict(meta.grad_scaler)
    st.step, st.epoch = meta.step, meta.epoch
    position = el_resume.carry_position(meta, job.par.dp, log)  # per data rank, at this dp size
    job.el.resumed(path, st.step)
    if position >= job.counts.epoch_len:
        st.epoch, position = st.epoch + 1, 0
    else:
        job.data.sampler.set_epoch(st.epoch)
        job.data.sampler.set_start(position)
    log(f"resumed from {path} at step {st.step}, epoch {st.epoch}", flush=True)
    old_ratio = sched.ratio
    if rz.ratio != 1 or old_ratio != 1:  # a global batch off the configured one: the schedule follows it
        c = job.counts
        left = el_resume.steps_left(spec, st.epoch, position, c.epoch_len, c.per_step, c.steps_per_epoch,
                                    sched.position(st.step), rz.ratio)
        job.counts = dataclasses.replace(c, total=st.step + left)
        sched.resize(st.step, rz.ratio, job.counts.total - st.step)
    if rz.changed:
        peak = effective_lr(spec)
        log(el_resume.describe_resize(rz, s.micro_batch, st.step, peak * old_ratio, peak * rz.ratio,
                                      sched.get_last_lr()[0], sched.position(st.step), sched.horizon,
                                      job.counts.total - st.step), flush=True)
        job.out.metrics.write("resize", step=st.step, **rz.record(), peak_lr_before=peak * old_ratio,
                              peak_lr_after=peak * rz.ratio, lr_now=sched.get_last_lr()[0],
                              schedule_position=sched.position(st.step), schedule_horizon=sched.horizon,
                              total_steps=job.counts.total)


def _announce(job: Job, st: TrainState, rz, path: Path | None) -> None:
    """The start record and line: world, layout, batch, LR, steps, the remainder's samples."""
    spec, s, ctx, par, c = job.spec, job.spec.schedule, job.ctx, job.par, job.counts
    scaled = f" x {rz.global_batch}/{s.global_batch} (on_resize scale_lr)" if rz.ratio != 1 else ""
    pad = job.data.sampler.padding
    job.out.metrics.write("start", world=ctx.world, nodes=ctx.world // ctx.local_world, global_batch=rz.global_batch,
                          micro_batch=s.micro_batch, grad_accum=c.accum, effective_lr=c.lr0, on_resize=rz.mode,
                          lr_scale=rz.ratio, base_lr=spec.optim.lr, ref_batch=spec.optim.ref_batch,
                          total_steps=c.total, steps_per_epoch=c.steps_per_epoch, train_samples=len(job.data.train_ds),
                          remainder=spec.data.remainder, padding=pad, resumed_from=str(path) if path else None,
                          start_step=st.step, device=str(ctx.device), backend=ctx.backend, dtype=spec.precision.dtype,
                          clip_grad_norm=spec.optim.clip_grad_norm, parallel=par.dims.describe(),
                          pipeline_split=par.split)
    job.log(f"world {ctx.world} ({ctx.world // ctx.local_world} nodes x {ctx.local_world}) on "
            f"{ctx.device}/{ctx.backend} | {par.dims.describe()}"
            f" | global batch {rz.global_batch} = {par.dp} data ranks x micro {s.micro_batch} x accum {c.accum}"
            f" | effective lr {c.lr0:g} = {spec.optim.lr:g} x {s.global_batch}/"
            f"{spec.optim.ref_batch or s.global_batch}{scaled}"
            f" | {c.total} steps, {c.steps_per_epoch}/epoch | remainder {spec.data.remainder}: "
            f"{abs(pad)} sample(s) {'repeated' if pad >= 0 else 'left out'} per epoch", flush=True)


def _step(job: Job, st: TrainState, loader, records: "_StepRecords", vote: "_StopVote") -> None:
    """One optimizer step, its record, and the checkpoint or agreed stop after it."""
    spec, el, prof = job.spec, job.el, job.out.prof
    prof.step(st.step)
    t0 = time.perf_counter()
    n_step = min(job.counts.per_step, job.counts.epoch_len - st.consumed)  # samples of this step on this rank
    n_micro = -(-n_step // spec.schedule.micro_batch)
    feed = _Feed(job, st.step)
    out = job.stepper.train_step(feed.batches(loader, n_micro), n_micro, n_step * job.counts.per_sample)
    with prof.phase("sync"):  # the step's loss over all replicas and the stop vote: read after the next step
        loss_all = rt.PendingSum([out.loss], job.ctx)
        vote.cast(el.stop.flag)
    lr = job.sched.get_last_lr()[0]
    job.sched.step()
    st.step += 1
    st.consumed += n_step
    dt = time.perf_counter() - t0
    st.rates.append(n_step * job.par.dp / dt)
    st.step_s.append(dt)
    fp16 = {} if out.loss_scale is None else {"loss_scale": out.loss_scale, "skipped": out.skipped}
    moe = step_record(job.par, job.ctx)   # a mixture of experts: routed, dropped, router loss, all-to-alls
    records.add(loss_all, step=st.step, epoch=st.epoch, lr=lr, samples_per_s=st.rates[-1], step_time_s=dt,
                data_time_s=feed.data_s, grad_norm=out.grad_norm if math.isfinite(out.grad_norm) else None,
                **fp16, **moe, time=time.time())
    el.on_step(st.step, st.epoch, dt, feed.data_s, time.perf_counter() - feed.sync_t0)
    every = spec.checkpoint.every_steps
    periodic = bool(every and st.step % every == 0) or (st.step == job.counts.total and spec.checkpoint.at_end)
    stop = st.step < job.counts.total and el.stop_here(vote.count(latest=periodic), st.step, periodic)
    if periodic or stop:
        records.flush()
        with prof.phase("checkpoint"):
            st.last_saved = _save(job, st) or st.last_saved
    if stop:
        raise el.stopped(st.step, st.last_saved)


class _Feed:
    """A step's micro-batches from the loader, on the device, with the time spent waiting for data."""

    def __init__(self, job: Job, step: int) -> None:
        self.job, self.step, self.data_s, self.sync_t0 = job, step, 0.0, time.perf_counter()

    def batches(self, loader, n_micro: int):
        job = self.job
        for i in range(n_micro):
            td = time.perf_counter()
            with job.out.prof.phase("data"):
                x, y = next(loader)
            self.data_s += time.perf_counter() - td
            x, y = x.to(job.ctx.device, non_blocking=True), y.to(job.ctx.device, non_blocking=True)
            if x.dim() == 4:
                x = x.contiguous(memory_format=job.data.fmt)
            if i == n_micro - 1:  # heartbeat: the last micro-batch enters the gradient sync
                job.el.before_sync(self.step)
                self.sync_t0 = time.perf_counter()
            yield x, y


class _StopVote:
    """Each rank's stop flag (SIGTERM/SIGINT), summed over the group without waiting for it: a
    step's vote is read after the next step (at once when this step saves anyway), and every rank
    reads the same votes, so all stop after the same step."""

    def __init__(self, ctx: rt.DistContext) -> None:
        self.ctx, self.pending = ctx, []

    def cast(self, flag: float) -> None:
        self.pending.append(rt.PendingSum([flag], self.ctx))

    def count(self, latest: bool) -> float:
        """Ranks told to stop, by the votes read now (all of them with ``latest``)."""
        ready = self.pending if latest else self.pending[:-1]
        self.pending = [] if latest else self.pending[-1:]
        return max((v.result()[0] for v in ready), default=0.0)


def _score(job: Job, st: TrainState) -> float:
    job.el.pause("eval")  # the hang watchdog judges training steps, not evaluation
    job.out.prof.end_memory()
    stats: dict = {}
    c, t = evaluate(job.par.model, job.data.held, job.ctx, job.spec, job.data.fmt, job.par, stats)
    extra, text = held_out_summary(job.data.held, c, t, stats["nll"])  # tokens: held-out loss, bits per byte
    st.held_stats.update(extra)
    job.out.metrics.write("eval", epoch=st.epoch, step=st.step, accuracy=c / t, correct=c, total=t, **extra)
    job.log(f"epoch {st.epoch} held-out accuracy {c / t:.4f} ({c}/{t}){text}", flush=True)
    return c / t


def _finish(job: Job, st: TrainState, wall: float) -> dict:
    job.out.prof.close()
    st.last_saved = job.el.finish() or st.last_saved
    trained = sum(r * t for r, t in zip(st.rates, st.step_s))  # samples of this start, all data ranks
    result = {"step": st.step, "epoch": st.epoch, "accuracy": st.accuracy, "world": job.ctx.world,
              "samples_per_s": training_rate(st.rates, st.step_s),  # training steps only (metrics.py)
              "wall_samples_per_s": trained / wall if wall > 0 and st.rates else None, "wall_s": wall,
              "checkpoint": str(st.last_saved) if st.last_saved else None, "global_batch": job.counts.global_batch,
              "effective_lr": job.counts.lr0, "grad_accum": job.counts.accum, "parallel": job.par.dims.describe()}
    result.update(st.held_stats)
    result.update(job.el.summary())
    result["memory"] = job.out.mem.gather(job.ctx)  # collective: every rank reaches it
    job.out.metrics.write("end", **result)
    job.out.metrics.close()
    return result


class _StepRecords:
    """A step's record (and log line) waits for the next step, which hides its loss all-reduce."""

    def __init__(self, metrics: MetricsWriter, log, every: int, total: int, dp_world: int) -> None:
        self.metrics, self.log, self.every, self.total, self.dp_world = metrics, log, every, total, dp_world
        self.pending = None

    def add(self, loss: rt.PendingSum, **rec) -> None:
        self.flush()
        self.pending = (loss, rec)

    def flush(self) -> None:
        if self.pending is None:
            return
        (loss, r), self.pending = self.pending, None
        r = {"step": r.pop("step"), "epoch": r.pop("epoch"), "loss": loss.result()[0] / self.dp_world, **r}
        self.metrics.write("step", **r)
        if r["step"] % self.every == 0 or r["step"] == self.total:
            self.log(f"step {r['step']}/{self.total} epoch {r['epoch']} loss {r['loss']:.4f} lr {r['lr']:.4g} "
                     f"{r['samples_per_s']:.0f} samples/s step {r['step_time_s'] * 1e3:.1f} ms "
                     f"(data {r['data_time_s'] * 1e3:.1f} ms)", flush=True)


def _save(job: Job, st: TrainState) -> Path | None:
    t0 = time.perf_counter()
    spec, scaler, c = job.spec, job.stepper.scaler, job.counts
    meta = CheckpointMeta(step=st.step, epoch=st.epoch, consumed=st.consumed, world_size=job.ctx.world,
                          data_world=job.par.dp, global_batch=c.global_batch, grad_accum=c.accum,
                          scheduler=job.sched.state_dict(),
                          grad_scaler=scaler.state_dict() if scaler is not None else None,
                          model=spec.model.name, signature=job.signature, job=spec.name, parallel=layout_of(spec),
                          total_steps=c.total, schedule_key=schedule_key(spec), run_id=run_id(),
                          example_input=input_record(job.data.train_ds[0][0],
                                                      getattr(job.data.train_ds, "vocab", None)))
    path = job.el.save(job.out.ckdir, st.step, job.par.model, job.optim, meta)
    if path is not None:
        job.out.metrics.write("ckpt", step=st.step, path=str(path), save_s=time.perf_counter() - t0)
    return path
