"""Numerics harness: run N steps of a job spec on real processes, compare with one process.

    out = spawn(run_steps, world=4, spec=spec, steps=3)   # per-step losses, full weights, bytes
    ref = run_steps_single(spec, steps=3)                  # the same, in this process

Every run draws the same batches (the reverse task, seeded) and the same initial weights
(seeded before the model is built): rank r of the data-parallel group takes rows
[r x B/dp, (r+1) x B/dp) of each global batch B, in micro-batches of ``micro_batch``.
The loss is the sum of the token cross-entropies divided by the step's scored tokens on
that rank, so the data-parallel mean of the gradients equals the single-process mean.
Workers join through a FileStore (no ports), one thread each.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.core.decoder import DECODERS
from tandem.train import runtime as rt
from tandem.train.loss import resolve_loss
from tandem.train.optim import build_optimizer
from tandem.train.parallel import parallelize
from tandem.train.parallel.comm import CommCounter
from tandem.train.parallel.materialize import Materializer, build_meta
from tandem.train.step import Stepper
from tandem.train.tasks import make_task


def local_state_bytes(par, optim) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards)."""
    from torch.distributed.tensor import DTensor

    def nb(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    params = {id(p): p for p in par.root.parameters()}.values()
    out = {"params": sum(nb(p) for p in params), "grads": sum(nb(p.grad) for p in params if p.grad is not None)}
    inner = getattr(optim, "optim", optim)     # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    out["optimizer"] = sum(nb(v) for st in inner.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def full_state(par) -> dict:
    """The full (unsharded) weights by name, on every rank; pipeline slices merged over pp."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if par.mesh is None:
        return {k: v.detach().clone() for k, v in par.root.state_dict().items()}
    sd = get_model_state_dict(par.root, options=StateDictOptions(full_state_dict=True, cpu_offload=False,
                                                                 broadcast_from_rank0=False))
    sd = {k: v.detach().cpu().clone() for k, v in sd.items()}
    if par.dims.pp > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, sd)
        merged: dict = {}
        for s in parts:
            merged.update(s)
        sd = merged
    return sd


def batches(spec, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples: the reverse task for the decoders (gpt, llama); for image models one global batch of Gaussian blobs
    (``_blobs``) repeated, so that a few steps' losses, on the same images, fall when training works
    (on fresh noise images each step they rose or fell by the luck of the draw)."""
    g = torch.Generator().manual_seed(spec.schedule.seed + 1)
    if spec.model.name in DECODERS:
        return make_task("reverse", n, spec.model.seq, spec.schedule.seed + 1)
    B = spec.schedule.global_batch  # images: one batch, trained on step after step (its loss must fall)
    x, y = _blobs(spec, min(n, B), g)
    reps = -(-n // len(y))
    return x.repeat(reps, 1, 1, 1)[:n], y.repeat(reps)[:n]


def _blobs(spec, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian images whose mean grows with the label: learnable, so "the model learns" in a few
    steps is a property of the training, not of a lucky draw of random labels."""
    m, size = spec.model, spec.data.image_size
    x = torch.randn(n, m.in_channels, size, size, generator=g)
    y = torch.randint(0, m.num_classes, (n,), generator=g)
    return x + 0.3 * y.view(-1, 1, 1, 1).float(), y


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _inject_inf(par, rank: int) -> None:
    """One gradient element set to inf on ``rank`` only, after backward and the dp sync: an fp16
    overflow that only that rank (one shard, one stage) can see."""
    if dist.get_rank() != rank if dist.is_initialized() else rank != 0:
        return
    for p in par.root.parameters():
        if p.grad is not None:
            _local(p.grad).view(-1)[0] = float("inf")
            return


def run_steps(spec, ctx, steps: int, count: bool = False, save: str = "", load: str = "",
              inf_at: int = -1, inf_rank: int = 0) -> dict:
    """``steps`` optimizer steps; ``load``: start from that DCP checkpoint; ``save``: write one at the end;
    ``inf_at``: put an inf in one gradient element of rank ``inf_rank`` at that step (0-based)."""
    s = spec.schedule
    rt.seed_everything(s.seed)
    model = build_meta(spec.model, ctx.device)  # as the trainer: meta, parallelize, materialize the shards
    par = parallelize(model, spec, ctx, materialize=Materializer(s.seed, ctx.device))
    optim = build_optimizer(spec, par)
    stepper = Stepper(par, optim, spec, ctx, resolve_loss(spec.model.loss))
    sync = par.finish_backward
    B, mb, dp = s.global_batch, s.micro_batch, par.dp
    per = B // dp
    x, y = batches(spec, steps * B)
    denom = per * (spec.model.seq // 2 if spec.model.name in DECODERS else 1)
    tp_rank = par.coords["tp"]
    if load:
        from tandem.train import checkpoint as ckpt
        ckpt.load(Path(load), par.model, optim, ctx)
        if not steps:
            return {"state": full_state(par), "rank": ctx.rank, "dims": par.dims.describe()}
    losses, states, counter = [], [], CommCounter()
    times, norms, skipped, scales, unchanged = [], [], [], [], None
    n_micro = per // mb
    for step in range(steps):
        t0 = time.perf_counter()
        lo = step * B + par.dp_rank * per
        xs, ys = x[lo:lo + per], y[lo:lo + per]
        micro = [(xs[i * mb:(i + 1) * mb], ys[i * mb:(i + 1) * mb]) for i in range(n_micro)]

        def finish(step=step):
            sync()
            if step == 0:
                states.append(local_state_bytes(par, optim))
            if step == inf_at:
                _inject_inf(par, inf_rank)
        par.finish_backward = finish
        # local tensors: a DTensor comparison would be a collective, and all() stops at the first False
        before = [_local(p).detach().clone() for p in par.root.parameters()] if step == inf_at else None
        with (counter if count else _null()):
            out = stepper.train_step(iter(micro), n_micro, denom)
        if before is not None:
            unchanged = all([torch.equal(a, _local(p).detach()) for a, p in zip(before, par.root.parameters())])
        norms.append(out.grad_norm)
        skipped.append(out.skipped)
        scales.append(out.loss_scale)
        scored = out.loss if (par.has_last and tp_rank == 0) else 0.0
        losses.append(rt.all_reduce_sum([scored], ctx)[0] / dp)
        times.append(time.perf_counter() - t0)
    par.finish_backward = sync
    if count and states:
        states[0]["optimizer"] = local_state_bytes(par, optim)["optimizer"]  # state exists after a step
    if save:
        from tandem.train import checkpoint as ckpt
        from tandem.train.checkpoint_meta import CheckpointMeta
        meta = CheckpointMeta(step=steps, epoch=0, world_size=ctx.world, job="check")
        ckpt.save(Path(save), steps, par.model, optim, ctx, meta, keep_last=1)
    steady = sorted(times[1:] or times)
    return {"losses": losses, "grad_norms": norms, "skipped": skipped, "scales": scales, "unchanged": unchanged,
            "eval": held_out_eval(spec, par, ctx), "step_s": steady[len(steady) // 2] if steady else None, "state": full_state(par), "bytes": states[0] if states else {},
            "comm": counter.summary(steps) if count else {}, "split": par.split, "dims": par.dims.describe(),
            "rank": ctx.rank}


def held_out_eval(spec, par, ctx) -> tuple[tuple[int, int], float]:
    """((correct, scored), logit fingerprint) of the trainer's held-out evaluation on 64 samples the
    steps did not see: under pp the stages' forward-only pass, elsewhere the (wrapped) model."""
    from torch.utils.data import TensorDataset

    from tandem.train.trainer import evaluate

    g = torch.Generator().manual_seed(spec.schedule.seed + 2)
    if spec.model.name in DECODERS:
        held = TensorDataset(*make_task("reverse", 64, spec.model.seq, spec.schedule.seed + 2))
    else:
        held = TensorDataset(*_blobs(spec, 64, g))
    model = par.model
    return evaluate(model, held, ctx, spec, par=par), _fingerprint(model, held, par, ctx, spec)


@torch.no_grad()
def _fingerprint(model, held, par, ctx, spec) -> float:
    """Mean squared logit of the held-out samples (all of them on every data rank): a few steps
    in, a model may predict one token everywhere, so equal accuracies alone could hide a wrong pass."""
    x = held.tensors[0]
    with rt.autocast(ctx, spec.precision.dtype):
        if par.schedule is not None:
            from tandem.train.parallel.pp import forward_only
            out = forward_only(par, x)
        else:
            out = model(x)
    if out is not None and hasattr(out, "full_tensor"):  # tp: a collective of the tp group
        out = out.full_tensor()
    mine = out is not None and par.coords["tp"] == 0
    total, n = rt.all_reduce_sum([float(out.double().pow(2).mean()) if mine else 0.0, float(mine)], ctx)
    model.train()
    return total / n


def run_many(specs: dict, ctx, steps: int, count: bool = False) -> dict:
    """Several configurations in one set of processes (saves the process start-up): name -> result.
    A configuration that fails records its traceback under its name instead."""
    out = {}
    for name, spec in specs.items():
        spec, kw = spec if isinstance(spec, tuple) else (spec, {})
        try:
            out[name] = run_steps(spec, ctx, kw.pop("steps", steps), count, **kw)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            print(out[name]["error"], file=sys.stderr, flush=True)  # its peers may hang: say why now
        dist.barrier()
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def run_steps_single(spec, steps: int, count: bool = False, **kw) -> dict:
    spec = copy.deepcopy(spec)
    spec.parallel.strategy, spec.parallel.tp, spec.parallel.pp, spec.parallel.cp = "ddp", 1, 1, 1
    spec.parallel.ep = 1
    spec.parallel.comm_hook, spec.parallel.local_sgd_every = "none", 0
    torch.set_num_threads(1)
    ctx = rt.DistContext(0, 1, 0, 1, 0, torch.device("cpu"), "gloo")
    return run_steps(spec, ctx, steps, count, **kw)


def _worker(rank: int, world: int, local_world: int, store: str, out: str, fn, args, kwargs):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(rank // local_world),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # a hung collective dumps every thread's stack to the error file and exits, instead of hanging a test
    err = open(f"{out}.{rank}.stacks", "w")
    faulthandler.dump_traceback_later(float(os.environ.get("TANDEM_WORKER_TIMEOUT", "300")), exit=True, file=err)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        ctx = rt.DistContext(rank, world, rank % local_world, local_world, rank // local_world,
                             torch.device("cpu"), "gloo")
        res = fn(*args, ctx=ctx, **kwargs)
        torch.save(res, f"{out}.{rank}")
    except BaseException:
        Path(f"{out}.{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():
            dist.destroy_process_group()
    # the result is on disk: leave without the interpreter's teardown, where gloo objects a model still holds
    # (a DTensor mesh's groups) can abort the process after the fact ("terminate called without an active
    # exception", SIGABRT: seen once in a CI run of the tp export test)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args, local_world: int | None = None, **kwargs) -> list:
    """Run ``fn(*args, ctx=ctx, **kwargs)`` on ``world`` fresh processes; every rank's result, in rank order.
    ``local_world``: ranks per simulated node (default: all on one)."""
    with tempfile.TemporaryDirectory() as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "res")
        try:
            mp.spawn(_worker, args=(world, local_world or world, store, out, fn, args, kwargs), nprocs=world,
                     join=True)
        except Exception as e:
            errs = sorted(Path(d).glob("res.*.err")) + [p for p in sorted(Path(d).glob("res.*.stacks"))
                                                         if p.stat().st_size]
            detail = "\n".join(p.read_text()[-4000:] for p in errs[:2])
            raise RuntimeError(f"worker failed: {e}\n{detail}") from e
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
