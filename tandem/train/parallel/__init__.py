"""Parallel strategies on one DeviceMesh: ``parallelize(model, spec, ctx)``.

The order, on each rank (torchtitan's):

1. degrees -> ``ParallelDims`` -> DeviceMesh (pp, dp_replicate, dp_shard, cp, tp);
2. pipeline split: keep only this rank's stages' blocks (``pp.keep_only``);
3. tensor parallel on the tp mesh (``tp.apply_tp``): DTensor parameters; context parallel on the
   cp mesh (``cp.apply_cp``): ring attention and per-chunk positions, gradients averaged over dp x cp;
   expert parallel on the ep mesh (``expert.apply_ep``): experts sharded by expert, tokens by all-to-all;
4. activation checkpointing per block (``ac.apply_ac``);
5. ``torch.compile`` per block (optional);
6. data parallel on the dp mesh: FSDP2 ``fully_shard`` for zero2, zero3 and hsdp (``fsdp``); a model
   built on the meta device is materialized here, its local shards only (``materialize``); then
   DDP / ZeRO-1 (``ddp``), or a bucketed gradient all-reduce when tp or pp rule DDP out;
7. pipeline stages and schedule over the (possibly sharded) skeleton (``pp.build_schedule``).

Tensor parallel must come before FSDP (FSDP shards the DTensors tp made, on the other mesh
dimension), and checkpointing and compile before FSDP so each FSDP unit wraps the final block.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.core.dims import SHARDED, ParallelDims, from_spec
from tandem.train.tasks import IGNORE

__all__ = ["Parallel", "parallelize", "ParallelDims", "from_spec"]


@dataclass
class Parallel:
    dims: ParallelDims
    model: nn.Module                 # what forward calls (DDP-wrapped, or the FSDP/tp root)
    root: nn.Module                  # the unwrapped module: checkpoints, signatures, parameters
    coords: dict
    mesh: object = None
    dp_mesh: object = None
    grad_sync: object = None         # bucketed dp all-reduce (tp / pp with ddp)
    schedule: object = None          # pipeline schedule (pp > 1)
    stages: list = field(default_factory=list)
    loss_parallel: bool = False
    split: str = ""                  # the pipeline split, printed
    hook_state: object = None        # comm hook / local SGD state
    averager: object = None          # local SGD model averager
    pp_loss: object = None           # pp: the schedule's loss function, fn(out, y) (tandem/train/step.py)
    cp: object = None                # context parallel (cp.ContextParallel): shards the batch, runs the ring
    grad_mesh: object = None         # the ranks averaging gradients: dp, flattened with cp when cp > 1
    ep: object = None                # expert parallel (expert.ExpertParallel): all-to-alls, expert gradients
    router_losses: object = None     # pp with a mixture of experts (pp.RouterLosses): each stage's router losses

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages) if self.stages else True

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages) if self.stages else True

    def dp_group(self):
        """The ranks holding the same parameters, averaging gradients (ZeRO-1's shards, comm hooks): dp x cp."""
        mesh = self.grad_mesh if self.grad_mesh is not None else self.dp_mesh
        return mesh.get_group() if mesh is not None else None

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """cp: this rank's chunks of each sequence of a batch (x or y); unchanged without cp."""
        return self.cp.shard(t) if self.cp is not None else t

    def loss_context(self):
        """Around a micro-batch's forward and backward: tp's loss parallel, cp's ring attention."""
        if not (self.loss_parallel or self.cp is not None):
            return nullcontext()
        from contextlib import ExitStack
        stack = ExitStack()
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            stack.enter_context(loss_parallel())
        if self.cp is not None:
            stack.enter_context(self.cp.sharded())
        return stack

    def no_sync(self, skip: bool):
        """Defer the data-parallel gradient sync on accumulation micro-batches (``skip``): DDP's
        ``no_sync``; zero2 keeps its parameters gathered and hsdp its replica all-reduce for the last."""
        if self.dims.dp * self.dims.cp > 1 and self.dims.strategy in ("zero2", "hsdp") and self.mesh is not None:
            if self.dims.strategy == "zero2":   # ZeRO-2: parameters stay gathered across the step's micro-batches
                self.model.set_reshard_after_backward(not skip, recurse=True)
            else:                               # hsdp: replicas all-reduce their shards once per step
                self.model.set_requires_all_reduce(not skip, recurse=True)
        if skip and isinstance(self.model, nn.parallel.DistributedDataParallel) and self.averager is None:
            return self.model.no_sync()
        return nullcontext()

    def finish_backward(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync()
        if self.ep is not None and self.dims.strategy == "ddp":   # FSDP2 reduces them on the edp mesh
            self.ep.sync_grads()

    def after_step(self) -> None:
        a = self.averager   # PeriodicModelAverager's schedule, on every parameter (its own helper skips
        if a is not None:   # parameters whose .grad is None, i.e. all of them after zero_grad(set_to_none))
            from torch.distributed.algorithms.model_averaging.utils import average_parameters
            if a.step >= a.warmup_steps and (a.step - a.warmup_steps) % a.period == 0:
                average_parameters(iter(list(self.root.parameters())), a.process_group)
            a.step += 1


def loss_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy over the scored targets: classes (N,) or token targets (N, T)."""
    if y.dim() == 2:
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE)
    return F.cross_entropy(out, y, reduction="sum")


def parallelize(model: nn.Module, spec, ctx, log=lambda *a: None, materialize=None) -> Parallel:
    """Apply the spec's strategy to a freshly built model (same seed on every rank). Collective.

    ``materialize``: for a model built on the meta device, called with the pruned, tp- and
    FSDP-sharded model before DDP wraps it (``materialize.Materializer``)."""
    p = spec.parallel
    dims = from_spec(spec, ctx.world, ctx.local_world)
    coords = dims.coords(ctx.rank)
    if ctx.world == 1 or not dist.is_initialized():
        if materialize is not None:
            materialize(model)
        return Parallel(dims, model, model, coords)
    mesh, dp_mesh = dims.build_mesh(ctx.device.type)
    par = Parallel(dims, model, model, coords, mesh=mesh, dp_mesh=dp_mesh)
    # cp ranks hold the same weights: gradients average over dp x cp (torchtitan's dp_cp), and FSDP shards over it
    grad_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp") if dims.cp > 1 else dp_mesh
    par.grad_mesh, n_grad = grad_mesh, dims.dp * dims.cp
    parts, mine = None, None
    if dims.pp > 1:
        from tandem.train.parallel import pp
        v = p.pp_virtual if p.pp_schedule == "interleaved" else 1
        parts = pp.split_layers(model, dims.pp * v, p.pp_split)
        par.split = pp.describe_split(model, parts)
        log(f"pipeline split ({p.pp_split}): {par.split}")
        mine = pp.stage_ids(coords["pp"], dims.pp, v)
        pp.keep_only(model, parts, mine)
    if dims.tp > 1:
        from tandem.train.parallel.tp import apply_tp
        par.loss_parallel = p.loss_parallel and getattr(model, model.layout.head) is not None
        apply_tp(model, mesh["tp"], p.sequence_parallel, par.loss_parallel)
    if dims.cp > 1:
        from tandem.train.parallel.cp import apply_cp
        par.cp = apply_cp(model, mesh["cp"].get_group(), spec.model.seq)
    if dims.ep > 1:
        from tandem.train.parallel.expert import apply_ep
        par.ep = apply_ep(model, dims.build_ep_mesh(ctx.device.type), dims)
    from tandem.train.parallel.ac import apply_ac
    apply_ac(model, p.activation_checkpoint, p.ac_every)
    if p.compile:
        from tandem.train.parallel.fsdp import blocks
        for b in blocks(model):
            b.compile()
    if n_grad > 1 and p.strategy in SHARDED:
        from tandem.train.parallel.fsdp import apply_fsdp
        if par.ep is not None:   # the experts' own units first, on the edp mesh
            from tandem.train.parallel.expert import shard_experts
            shard_experts(model, par.ep, p.strategy != "zero2")
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"] if p.strategy == "hsdp" else grad_mesh, p.strategy)
    if materialize is not None:  # a meta model: allocate the local shards now, before DDP broadcasts
        materialize(model)
    if n_grad > 1 and p.strategy not in SHARDED:
        if dims.tp > 1 or dims.pp > 1:
            from tandem.train.parallel.ddp import GradSync
            # the expert weights differ by ep rank: sync_grads reduces them over their own group
            experts = {id(q) for q in par.ep.params} if par.ep is not None else set()
            par.grad_sync = GradSync([q for q in model.parameters() if id(q) not in experts], grad_mesh.get_group(),
                                     n_grad, p.bucket_cap_mb)
        else:
            from tandem.train.parallel.ddp import wrap_ddp
            if par.ep is not None:   # the expert weights differ by rank: sync_grads reduces them
                from tandem.train.parallel.expert import ddp_ignore
                ddp_ignore(model, par.ep)
            par.model = wrap_ddp(model, p, ctx.device, grad_mesh.get_group())
            from tandem.train.parallel.comm_hooks import install
            install(par, p)
    if dims.pp > 1:
        from tandem.train.parallel import pp

        def loss_fn(out, y):  # set by the trainer's Stepper (tandem/train/step.py): scaled, per step
            return par.pp_loss(out, y)

        n_micro = spec.schedule.global_batch // (dims.dp * spec.schedule.micro_batch)
        par.schedule, par.stages, par.router_losses = pp.build_schedule(model, parts, mine, coords["pp"], dims.pp,
                                                     mesh["pp"].get_group(), ctx.device, p.pp_schedule,
                                                     n_micro, loss_fn)
    return par

