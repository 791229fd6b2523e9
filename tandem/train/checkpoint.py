"""Checkpoints with torch.distributed.checkpoint (DCP), published atomically.

Layout of a checkpoint folder (``<dir>/step-00000120/``):

    .metadata, __0_0.distcp ...   DCP: model and optimizer state (sharded by rank)
    rng-rank<R>.pt                 each rank's Python/NumPy/torch RNG states
    meta.json                      step, epoch, position in the epoch, scheduler,
                                   world size, model name and signature (shapes)

A save writes into ``<dir>/.tmp-step-.../``; rank 0 renames it to its final name only
after every rank finished, then moves ``<dir>/latest`` (a one-line file, replaced
atomically) and deletes checkpoints beyond ``keep_last``. A folder without
``.metadata`` or ``meta.json`` is incomplete and never loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tandem.core.errors import CheckpointError
from tandem.train.runtime import DistContext, barrier, rng_state, set_rng_state

_STEP = re.compile(r"^step-(\d+)$")


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / "meta.json").is_file()


def list_complete(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint: the ``latest`` pointer if valid, else a scan."""
    pointer = ckpt_dir / "latest"
    if pointer.is_file():
        p = ckpt_dir / pointer.read_text().strip()
        if is_complete(p):
            return p
    done = list_complete(ckpt_dir)
    return done[-1] if done else None


def read_meta(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError("not a checkpoint folder", field="checkpoint.resume", value=str(path),
                              fix="give a folder like runs/<job>/checkpoints/step-00000100, or 'auto'")
    if not is_complete(path):
        missing = [n for n in (".metadata", "meta.json") if not (path / n).is_file()]
        raise CheckpointError(f"incomplete checkpoint (missing {', '.join(missing)})", field="checkpoint.resume",
                              value=str(path), fix="resume from an earlier complete checkpoint, or 'auto' "
                                                   "(which skips incomplete ones)")
    return json.loads((path / "meta.json").read_text())


def check_compatible(meta: dict, model_name: str, signature: dict[str, list[int]], path: Path) -> None:
    """Refuse a checkpoint of another model or shape, naming the first difference."""
    theirs = meta.get("signature", {})
    if meta.get("model") != model_name or theirs != signature:
        diff = next((k for k in sorted(set(theirs) | set(signature)) if theirs.get(k) != signature.get(k)), None)
        detail = (f"'{diff}' is {theirs.get(diff)} in the checkpoint but {signature.get(diff)} in this model"
                  if diff else f"model {meta.get('model')!r} vs {model_name!r}")
        raise CheckpointError(f"checkpoint is of another model or shape: {detail}", field="checkpoint.resume",
                              value=str(path), fix="resume with the model spec it was saved with, or set "
                                                   "checkpoint.resume=none / a fresh checkpoint.dir")


def save(ckpt_dir: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer, ctx: DistContext,
         meta: dict, keep_last: int) -> Path | None:
    """Collective: every rank calls it. Returns the published folder (None if it already existed)."""
    final = ckpt_dir / f"step-{step:08d}"
    if is_complete(final):  # never overwrite a complete checkpoint (e.g. resumed at its step)
        return None
    tmp = ckpt_dir / f".tmp-step-{step:08d}"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / f"rng-rank{ctx.rank}.pt")
    barrier()
    if ctx.is_main:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "world_size": ctx.world}, indent=1))
        os.replace(tmp, final)
        pointer = ckpt_dir / "latest.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, ckpt_dir / "latest")
        for old in list_complete(ckpt_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load(path: Path, model: nn.Module, optim: torch.optim.Optimizer, ctx: DistContext) -> dict:
    """Collective: restore model and optimizer (any world size), and RNG when the world matches."""
    meta = read_meta(path)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = Path(path) / f"rng-rank{ctx.rank}.pt"
    if meta.get("world_size") == ctx.world and rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return meta
