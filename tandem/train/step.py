"""One training step, the same on every strategy (ddp, zero1-3, hsdp, tp, pp and their meshes).

    stepper = Stepper(par, optim, spec, ctx, resolve_loss(spec.model.loss), phase=prof.phase)
    out = stepper.train_step(micro_batches, n_micro, denom)   # -> StepResult

``forward_backward_step`` owns what each micro-batch needs: autocast, the fp16 loss scale,
skipping the data-parallel gradient sync on all micro-batches but the last (DDP's ``no_sync``;
FSDP2 keeps zero2's parameters gathered and hsdp's replica all-reduce for the last), and the loss
parallel context of tp. Under pp it runs the pipeline schedule over the whole step's micro-batches,
whose loss function (built by ``parallelize``) calls back ``_pp_loss`` here, which scales it.

``train_step``: the micro-batches, the gradient sync that tp/pp need (``finish_backward``), then
unscale (fp16), the global gradient norm (logged, and clipped to ``optim.clip_grad_norm`` when set),
the optimizer step (skipped by the scaler on every rank together when a gradient overflowed),
``zero_grad`` and local SGD's averaging.

The loss of a micro-batch is its *sum* over the scored targets divided by ``denom``, the scored
targets of the whole step on this rank (tandem/train/loss.py): the gradient is the exact mean.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from tandem.train import runtime as rt
from tandem.train.loss import Loss, scored
from tandem.train.parallel import Parallel
from tandem.train.parallel.grads import clip_grads_, global_grad_norm, grad_scaler


@dataclass
class TrainState:
    """Where the run is: what a checkpoint restores, and what the loop reports at the end."""

    step: int = 0                 # optimizer steps done
    epoch: int = 0
    consumed: int = 0             # samples of this epoch this rank has trained on
    last_saved: Path | None = None
    accuracy: float | None = None
    scored_at: int | None = None  # the step the last held-out evaluation saw
    rates: list[float] = field(default_factory=list)  # samples/s of each step
    step_s: list[float] = field(default_factory=list)  # seconds of each step (data waits included)
    held_stats: dict = field(default_factory=dict)    # token sets: held-out loss, bits per byte (last eval)


@dataclass
class StepResult:
    loss: float                   # this rank's part of the step's mean loss (0.0 where it is not scored)
    grad_norm: float              # global gradient norm before clipping (inf/nan: an overflow)
    skipped: bool = False         # fp16: a gradient overflowed and no rank stepped
    loss_scale: float | None = None  # fp16: the scale after this step's update


def _no_phase(name: str):
    return nullcontext()


class Stepper:
    def __init__(self, par: Parallel, optim, spec, ctx: rt.DistContext, loss: Loss, phase=None) -> None:
        self.par, self.optim, self.ctx, self.loss = par, optim, ctx, loss
        self.dtype, self.clip = spec.precision.dtype, spec.optim.clip_grad_norm
        self.scaler = grad_scaler(ctx.device, self.dtype)
        if self.scaler is not None:  # pp: stages without the loss never call scale(), yet unscale and step
            self.scaler.scale(torch.zeros((), device=ctx.device))
        self.phase = phase or _no_phase
        self.params = list(par.root.parameters())
        self.pp_group = par.mesh["pp"].get_group() if par.mesh is not None and par.dims.pp > 1 else None
        par.pp_loss = self._pp_loss
        self._denom = 1.0

    def autocast(self):
        return rt.autocast(self.ctx, self.dtype)

    def _pp_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.loss.fn(out, y) / self._denom
        return self.scaler.scale(loss) if self.scaler else loss

    def forward_backward_step(self, x: torch.Tensor, y: torch.Tensor, denom: float, sync: bool = True) -> float:
        """Backward of sum-loss / ``denom`` for one micro-batch (under pp: the step's micro-batches,
        concatenated); ``sync=False`` defers the data-parallel gradient sync. Returns the loss."""
        par = self.par
        if par.schedule is not None:
            from tandem.train.parallel import pp
            self._denom = denom
            scale = float(self.scaler.get_scale()) if self.scaler else 1.0  # a power of 2: exact
            router = par.router_losses
            if router is not None:   # each micro-batch's router losses weigh as its share of the scored targets
                router.start([scored(m) / denom for m in y.chunk(par.schedule._n_microbatches)], scale)
            with self.phase("forward_backward"), par.loss_context(), self.autocast():
                losses = pp.step(par.schedule, x, y, par.has_first, par.has_last)
            loss = float(sum(l.detach().float() for l in losses)) / scale if losses else 0.0
            if router is not None:   # the stages' router losses, summed over the pp group, join the logged loss
                loss += rt.all_reduce_sum([router.value], self.ctx, group=self.pp_group)[0]
            return loss
        x, y = par.shard(x), par.shard(y)   # cp: this rank's chunks of each sequence (tandem/train/parallel/cp.py)
        with par.no_sync(not sync), par.loss_context(), self.autocast():
            with self.phase("forward"):
                loss = self.loss(par.model, x, y) / denom
            # cp: the gradients average over dp x cp, and this rank's tokens are 1/cp of its replica's: x cp
            back = loss * par.dims.cp if par.cp is not None else loss
            with self.phase("backward"):
                (self.scaler.scale(back) if self.scaler else back).backward()
        return float(loss.detach())

    def train_step(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n_micro: int,
                   denom: float) -> StepResult:
        """One optimizer step over ``n_micro`` micro-batches (x, y), already on the device."""
        par, loss = self.par, 0.0
        if par.schedule is not None:  # the schedule runs the step's micro-batches at once
            xs, ys = zip(*batches)
            loss = self.forward_backward_step(torch.cat(xs), torch.cat(ys), denom)
        else:
            for i, (x, y) in enumerate(batches):
                loss += self.forward_backward_step(x, y, denom, sync=i == n_micro - 1)
        with self.phase("sync"):
            par.finish_backward()  # tp/pp with dp: the gradient all-reduce DDP would have done
        with self.phase("optimizer"):
            out = self.clip_and_step()
            self.optim.zero_grad(set_to_none=True)
        with self.phase("sync"):
            par.after_step()  # local SGD: average the models every H steps
        out.loss = loss if par.has_last and par.coords["tp"] == 0 else 0.0  # one copy per replica
        return out

    def clip_and_step(self) -> StepResult:
        s = self.scaler
        if s is not None:
            s.unscale_(self.optim)  # the true gradients, for the norm and the clip
        norm = float(global_grad_norm(self.params, self.pp_group))
        if self.clip > 0 and math.isfinite(norm):
            clip_grads_(self.params, self.clip, torch.tensor(norm))
        if s is None:
            self.optim.step()
            return StepResult(0.0, norm)
        skipped = s.found_inf(self.optim)
        norm = math.inf if skipped else norm  # an overflow on any rank: inf on every rank (a rank's own may be finite)
        s.step(self.optim)  # skips optimizer.step() on an overflow (the same verdict on every rank)
        s.update()
        return StepResult(0.0, norm, skipped, float(s.get_scale()))
