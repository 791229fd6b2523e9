"""Peak memory of building and training a spec on each rank, phase by phase (tests and benches).

    out = spawn(build_and_step, world=2, spec=spec, steps=1)
    out[r] = {"built": bytes, "step": bytes, "model_bytes": full fp32 bytes, "local_param_bytes": ...}

``built``: the rank's peak above its baseline while the model is built on the meta device,
parallelized and materialized (what a rank must hold to start; with zero3, its shard plus one
full tensor). ``step``: the peak above the same baseline after ``steps`` optimizer steps (AdamW).
The baseline is taken after every module the build and the step import is loaded, so it
holds the runtime and nothing of the model (``tandem/train/peak_memory.py``).
"""

from __future__ import annotations

import torch


def build_and_step(spec, ctx, steps: int = 1) -> dict:
    import torch.distributed.checkpoint  # noqa: F401  (loaded before the baseline: runtime, not model)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    from harness.numerics import batches, local_state_bytes
    from tandem.core.decoder import DECODERS
    from tandem.train import runtime as rt
    from tandem.train.loss import resolve_loss
    from tandem.train.optim import build_optimizer
    from tandem.train.parallel import parallelize
    from tandem.train.parallel.materialize import Materializer, build_meta
    from tandem.train.peak_memory import PeakMemory
    from tandem.train.step import Stepper

    s = spec.schedule
    x, y = batches(spec, s.global_batch * max(steps, 1))
    mem = PeakMemory(ctx.device)
    rt.seed_everything(s.seed)
    model = build_meta(spec.model, ctx.device)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    par = parallelize(model, spec, ctx, materialize=Materializer(s.seed, ctx.device))
    built = mem.peak() - mem.baseline
    optim = build_optimizer(spec, par)
    stepper = Stepper(par, optim, spec, ctx, resolve_loss(spec.model.loss))
    per = s.global_batch // par.dp
    denom = per * (spec.model.seq // 2 if spec.model.name in DECODERS else 1)
    mb = s.micro_batch
    for step in range(steps):
        lo = step * s.global_batch + par.dp_rank * per
        xs, ys = x[lo:lo + per], y[lo:lo + per]
        micro = [(xs[i * mb:(i + 1) * mb], ys[i * mb:(i + 1) * mb]) for i in range(per // mb)]
        stepper.train_step(iter(micro), len(micro), denom)
    return {"built": built, "step": mem.peak() - mem.baseline, "model_bytes": full, "kind": mem.local()["kind"],
            "local_param_bytes": local_state_bytes(par, optim)["params"], "rank": ctx.rank,
            "dims": par.dims.describe()}


def model_bytes(spec) -> int:
    """fp32 bytes of the spec's full model, counted on the meta device."""
    from tandem.train.parallel.materialize import build_meta
    m = build_meta(spec.model, torch.device("meta"))
    return sum(p.numel() * p.element_size() for p in m.parameters())
