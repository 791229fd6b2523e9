"""Expert parallelism on real processes: evaluation of a held-out set whose shares differ by rank, and the
expert states each rank holds.

    (correct, scored) = spawn(eval_uneven, world=2, spec=spec, n=513)[0]
    spawn(expert_state_bytes, world=4, specs={name: spec})[r][name] = {"params": B, "grads": B, "optimizer": B, ...}

513 samples on 2 data ranks: rank 0 scores 257 (two batches of the trainer's 256), rank 1 256 (one), and
every forward of an ep run joins the experts' all-to-alls: the trainer's ``evaluate`` runs as many on
every rank (tandem/train/trainer.py), or rank 0 would wait for a peer that finished.
"""

from __future__ import annotations

from torch.utils.data import TensorDataset

from tandem.train import runtime as rt
from tandem.train.parallel import parallelize
from tandem.train.parallel.materialize import Materializer, build_meta
from tandem.train.tasks import make_task
from tandem.train.trainer import evaluate


def eval_uneven(spec, ctx, n: int = 513) -> tuple[int, int]:
    rt.seed_everything(spec.schedule.seed)
    model = build_meta(spec.model, ctx.device)
    par = parallelize(model, spec, ctx, materialize=Materializer(spec.schedule.seed, ctx.device))
    held = TensorDataset(*make_task("reverse", n, spec.model.seq, spec.schedule.seed + 3))
    return evaluate(par.model, held, ctx, spec, par=par)


def expert_state_bytes(specs: dict, ctx) -> dict:
    """name -> the bytes of this rank's routed-expert parameters, their gradients (after the step's reduction,
    before the optimizer) and their optimizer state (after one AdamW step), local shards only: what the trainer
    holds of ``GroupedExperts`` under each spec's layout (tandem/train/parallel/expert.py)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from harness.numerics import batches
    from tandem.core.decoder import DECODERS
    from tandem.train.loss import resolve_loss
    from tandem.train.optim import build_optimizer
    from tandem.train.parallel.expert import expert_modules
    from tandem.train.step import Stepper

    def nb(x) -> int:
        x = x.to_local() if isinstance(x, DTensor) else x
        return x.numel() * x.element_size()

    out = {}
    for name, spec in specs.items():
        s = spec.schedule
        rt.seed_everything(s.seed)
        model = build_meta(spec.model, ctx.device)
        par = parallelize(model, spec, ctx, materialize=Materializer(s.seed, ctx.device))
        experts = [p for mod in expert_modules(par.root) for p in mod.parameters()]
        assert experts, f"{name}: no GroupedExperts in the model"
        optim = build_optimizer(spec, par)
        stepper = Stepper(par, optim, spec, ctx, resolve_loss(spec.model.loss))
        got, sync = {"params": sum(nb(p) for p in experts)}, par.finish_backward

        def finish():
            sync()
            got["grads"] = sum(nb(p.grad) for p in experts if p.grad is not None)
        par.finish_backward = finish
        per = s.global_batch // par.dp
        x, y = batches(spec, s.global_batch)
        lo = par.dp_rank * per
        micro = [(x[lo + i:lo + i + s.micro_batch], y[lo + i:lo + i + s.micro_batch])
                 for i in range(0, per, s.micro_batch)]
        stepper.train_step(iter(micro), len(micro), per * (spec.model.seq // 2 if spec.model.name in DECODERS else 1))
        par.finish_backward = sync
        inner = getattr(optim, "optim", optim)
        got["optimizer"] = sum(nb(v) for p in experts for v in inner.state.get(p, {}).values()
                               if isinstance(v, torch.Tensor) and v.dim() > 0)
        got["dims"], got["grad_group"] = par.dims.describe(), dist.get_world_size(par.ep.grad_group)
        out[name] = got
        dist.barrier()
    return out
