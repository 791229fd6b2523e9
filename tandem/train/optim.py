"""The one optimizer builder: SGD or AdamW at the spec's effective LR, on every strategy.

Under zero1 the same optimizer class runs inside torch's ``ZeroRedundancyOptimizer`` over the
data-parallel group (each rank keeps and steps the state of 1/dp of the parameters, then
broadcasts its slice); FSDP2 strategies need nothing special here, their parameters are already
DTensor shards, so the optimizer's state is sharded with them.
"""

from __future__ import annotations

import torch

from tandem.core.spec import JobSpec
from tandem.core.validate import effective_lr


def optimizer_class(spec: JobSpec) -> tuple[type, dict]:
    o = spec.optim
    if o.name == "sgd":
        return torch.optim.SGD, dict(momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay)
    return torch.optim.AdamW, dict(betas=tuple(o.betas), weight_decay=o.weight_decay)


def build_optimizer(spec: JobSpec, par) -> torch.optim.Optimizer:
    """``par``: the ``Parallel`` that ``parallelize`` returned (its root module's parameters)."""
    cls, kw = optimizer_class(spec)
    lr = effective_lr(spec)
    # ZeRO-1 shards the optimizer state over the ranks holding the same weights: dp, times cp
    if spec.parallel.strategy == "zero1" and par.mesh is not None and par.dp * par.dims.cp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(list(par.root.parameters()), optimizer_class=cls,
                                       process_group=par.dp_group(), lr=lr, **kw)
    return cls(par.root.parameters(), lr=lr, **kw)
