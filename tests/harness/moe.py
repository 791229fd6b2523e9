"""Expert-parallel evaluation on real processes: a held-out set whose shares differ by rank.

    (correct, scored) = spawn(eval_uneven, world=2, spec=spec, n=513)[0]

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
