"""Every check that needs no process group: what `tandem train` runs before launching and
`tandem spec` prints, in one function.

    check_job(spec)              device, spec, model (built on the meta device), data source
    check_job(spec, run_dir)     ... and the checkpoint the run would resume (tandem train): (path, meta)

torch is imported only when an answer depends on it: the device when something in the
spec needs a GPU (sync_bn, nccl, device=cuda), and the model unless it is a built-in
ResNet (whose build is arithmetic on sizes `validate` already checked). `tandem train`
passes ``quick=False``: it always builds the model, on the meta device (no memory, no init).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tandem.core.errors import TandemError
from tandem.core.spec import JobSpec
from tandem.core.validate import validate
from tandem.train.checkpoint_meta import CheckpointMeta
from tandem.train.datacheck import RESNETS, check_source


def _device_matters(spec: JobSpec) -> bool:
    """Whether validate's answer depends on the device (its checks that refuse a CPU)."""
    return spec.model.sync_bn or spec.launch.backend == "nccl"


def resolve_device(spec: JobSpec, quick: bool = False) -> str:
    """cpu | cuda as the launcher will choose it; 'auto' when ``quick`` and nothing depends on it."""
    dev = spec.launch.device
    if dev == "cpu" or (quick and dev == "auto" and not _device_matters(spec)):
        return dev
    from tandem.core.environment import resolve_device as env_device

    return env_device(spec.launch.device, spec.launch.backend)[0]


def build_on_meta(spec: JobSpec):
    """The spec's model on the meta device: its import, factory, type and shapes, no memory used."""
    import torch

    from tandem.models import build_model

    try:
        with torch.device("meta"):
            return build_model(spec.model)
    except TandemError:
        if ":" not in spec.model.name:
            raise
        # A factory may read its tensors (meta ones hold no data): a real build gives the workers' verdict.
        return build_model(spec.model)


def check_job(spec: JobSpec, run_dir: Path | None = None, *,
              quick: bool = False) -> tuple[Path | None, CheckpointMeta | None]:
    """Raise a one-line TandemError for anything that would fail once the workers start.
    With ``run_dir``: the checkpoint the run would resume and its meta (None, None: a fresh start)."""
    device = resolve_device(spec, quick)
    validate(dataclasses.replace(spec, launch=dataclasses.replace(spec.launch, device=device)))
    model = None
    if not quick or spec.model.name not in RESNETS or ":" in spec.data.name:
        model = build_on_meta(spec)
    if ":" in spec.model.loss:  # the loss function imports as the workers will import it
        from tandem.train.loss import resolve_loss
        resolve_loss(spec.model.loss)
    check_source(spec, model)
    if run_dir is not None:
        from tandem.train.elastic.resume import resume_path

        path = resume_path(spec, run_dir)
        if path is not None:
            from tandem.models import model_signature
            from tandem.train import checkpoint as ckpt

            meta = ckpt.read_meta(path)
            ckpt.check_compatible(meta, spec.model.name, model_signature(model or build_on_meta(spec)), path)
            return path, meta
    return None, None
