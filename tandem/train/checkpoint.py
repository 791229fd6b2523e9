"""Checkpoints with torch.distributed.checkpoint (DCP), published atomically.

Layout of a checkpoint folder (``<dir>/step-00000120/``):

    .metadata, __0_0.distcp ...   DCP: model and optimizer state (sharded by rank)
    rng-rank<R>.pt                 each rank's Python/NumPy/torch RNG states
    meta.json                      step, epoch, position in the epoch, scheduler,
                                   world size, model name and signature (shapes):
                                   CheckpointMeta (checkpoint_meta.py)

A save writes into ``<dir>/.tmp-step-.../``; rank 0 renames it to its final name only
after every rank finished, then moves ``<dir>/latest`` (a one-line file, replaced
atomically) and deletes checkpoints beyond ``keep_last``. A folder without
``.metadata`` or ``meta.json`` is incomplete and never loaded. Before the rename rank 0
writes ``manifest.json`` (sha256 of every file, see manifest.py): ``latest`` skips a
checkpoint whose files no longer match it, and an explicit resume refuses it.
With ``async_save`` the shards are written by ``dcp.async_save`` in a background thread
(on a process group of its own) and rank 0 publishes the folder in a thread of its own
(PendingSave): training blocks only for the staging copy.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

from tandem.core.errors import CheckpointError
from tandem.train import checkpoint_meta, manifest
from tandem.train.checkpoint_meta import CheckpointMeta
from tandem.train.elastic import faults
from tandem.train.rng import rng_state, set_rng_state
from tandem.train.runtime import DistContext, barrier, sync_buffers

def _dcp():
    """torch.distributed.checkpoint, imported on first use: 1.2 s that the launcher's checks
    (read_meta, latest, check_compatible) do not need."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    # Optimizer state keyed per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): every
    # layout (ddp, zero1..3, tp, pp) writes and reads the same keys, so checkpoints reshard across them.
    return dcp, StateDictOptions(flatten_optimizer_state_dict=True), get_state_dict, set_state_dict


def _optim(optim):
    """ZeroRedundancyOptimizer (zero1): its rank's shard optimizer, whose keys DCP merges across ranks.
    Not imported to ask: torch.distributed.optim scripts its functional optimizers on import (~0.3 s
    of CPU per worker, more on a busy host), and an optimizer of that class exists only once
    tandem/train/optim.py imported it."""
    zero = sys.modules.get("torch.distributed.optim")
    return optim.optim if zero is not None and isinstance(optim, zero.ZeroRedundancyOptimizer) else optim


_STEP = re.compile(r"^step-(\d+)$")


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / "meta.json").is_file()


def list_complete(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


SKIPPED: dict[str, str] = {}  # checkpoints ``latest`` refused (path -> why), for the trainer's log


def latest(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint that matches its manifest: the ``latest`` pointer if
    valid, else a scan; a checkpoint failing its manifest is skipped with a warning."""
    pointer = ckpt_dir / "latest"
    found = list(reversed(list_complete(ckpt_dir)))
    if pointer.is_file():
        p = ckpt_dir / pointer.read_text().strip()
        if is_complete(p):
            found = [p] + [q for q in found if q != p]
    for p in found:
        bad = manifest.problem(p)
        if bad is None:
            return p
        if str(p) not in SKIPPED:
            print(f"tandem: skipping checkpoint {p.name}: {bad}; falling back to an earlier one",
                  file=sys.stderr, flush=True)
        SKIPPED[str(p)] = bad
    return None


def read_meta(path: Path) -> CheckpointMeta:
    """The meta of a complete checkpoint that matches its manifest (old versions upgraded)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError("not a checkpoint folder", field="checkpoint.resume", value=str(path),
                              fix="give a folder like runs/<job>/checkpoints/step-00000100, or 'auto'")
    if not is_complete(path):
        missing = [n for n in (".metadata", "meta.json") if not (path / n).is_file()]
        raise CheckpointError(f"incomplete checkpoint (missing {', '.join(missing)})", field="checkpoint.resume",
                              value=str(path), fix="resume from an earlier complete checkpoint, or 'auto' "
                                                   "(which skips incomplete ones)")
    manifest.verify(path)
    return checkpoint_meta.read(path)


def check_compatible(meta: CheckpointMeta, model_name: str, signature: dict[str, list[int]], path: Path) -> None:
    """Refuse a checkpoint of another model or shape, naming the first difference."""
    theirs = meta.signature
    if meta.model != model_name or theirs != signature:
        diff = next((k for k in sorted(set(theirs) | set(signature)) if theirs.get(k) != signature.get(k)), None)
        detail = (f"'{diff}' is {theirs.get(diff)} in the checkpoint but {signature.get(diff)} in this model"
                  if diff else f"model {meta.model!r} vs {model_name!r}")
        raise CheckpointError(f"checkpoint is of another model or shape: {detail}", field="checkpoint.resume",
                              value=str(path), fix="resume with the model spec it was saved with, or set "
                                                   "checkpoint.resume=none / a fresh checkpoint.dir")


def clean_partial(ckpt_dir: Path) -> list[str]:
    """Delete ``.tmp-step-*`` folders left by a save that died, and ``.tmp-pruned-*`` ones left by
    a pruning that died (call on rank 0 before training)."""
    d = Path(ckpt_dir)
    gone = sorted(p.name for pat in (".tmp-step-*", ".tmp-pruned-*") for p in d.glob(pat) if p.is_dir()) \
        if d.is_dir() else []
    for name in gone:
        shutil.rmtree(Path(ckpt_dir) / name, ignore_errors=True)
    return gone


def save(ckpt_dir: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer, ctx: DistContext,
         meta: CheckpointMeta, keep_last: int, async_pg=None):
    """Collective: every rank calls it. Returns the published folder (None if it already existed),
    or, given ``async_pg`` (a gloo group for dcp.async_save), a PendingSave to ``poll``/``wait``."""
    final = ckpt_dir / f"step-{step:08d}"
    if is_complete(final) and manifest.problem(final) is None:  # never overwrite a good checkpoint
        return None
    tmp = ckpt_dir / f".tmp-step-{step:08d}"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    sync_buffers(model, ctx)  # else DCP keeps one rank's BatchNorm stats, not necessarily rank 0's
    dcp, opts, get_state_dict, _ = _dcp()
    model_sd, optim_sd = get_state_dict(model, _optim(optim), options=opts)
    if async_pg is not None:
        torch.save(rng_state(), tmp / f"rng-rank{ctx.rank}.pt")
        fut = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), process_group=async_pg)
        faults.point("async_save", step=step, rank=ctx.rank)  # fault injection: die with the write in flight
        return PendingSave(fut, ckpt_dir, step, tmp, final, ctx, meta, keep_last)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / f"rng-rank{ctx.rank}.pt")
    return publish(ckpt_dir, step, tmp, final, ctx, meta, keep_last)


def publish(ckpt_dir: Path, step: int, tmp: Path, final: Path, ctx: DistContext, meta: CheckpointMeta,
            keep_last: int) -> Path:
    """Collective (sync saves), after every rank wrote its files: rank 0 publishes between two barriers."""
    faults.point("save", step=step, rank=ctx.rank)  # fault injection: die with the shards written
    barrier()
    if ctx.is_main:
        publish_files(ckpt_dir, step, tmp, final, meta, keep_last)
    barrier()
    return final


def publish_files(ckpt_dir: Path, step: int, tmp: Path, final: Path, meta: CheckpointMeta, keep_last: int) -> None:
    """Rank 0 only, no collective: meta, manifest, rename, pointer, pruning. The order is the
    safety argument: a kill before the rename leaves ``.tmp-step-N`` (cleaned at the next start),
    a kill before the pointer moves leaves a complete, hashed ``step-N`` and the old pointer."""
    checkpoint_meta.write(tmp, meta)
    manifest.write(tmp, step)
    faults.point("publish", step=step, rank=0)  # fault injection: die hashed, not yet renamed
    if final.exists():  # a copy that failed its manifest: replaced by this good one
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = ckpt_dir / "latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, ckpt_dir / "latest")
    for old in list_complete(ckpt_dir)[:-keep_last]:
        gone = old.with_name(".tmp-pruned-" + old.name)  # renamed first: a kill mid-delete leaves no half folder
        os.replace(old, gone)
        shutil.rmtree(gone, ignore_errors=True)


class PendingSave:
    """An async save in flight, published off the training thread.

    DCP's writer thread writes this rank's shards, then its finish step gathers every rank's
    result on rank 0 over the save's own process group and raises if any rank failed; only
    then does rank 0 write ``.metadata`` and complete its future. So on rank 0 a completed
    future means every rank's files are on disk, and a thread of ours publishes (hash, rename,
    pointer, pruning) with no further collective. The training thread only calls ``poll``
    (never blocks) or ``wait`` (before the next save and at the end: one save in flight)."""

    def __init__(self, fut, ckpt_dir, step, tmp, final, ctx, meta, keep_last) -> None:
        self.fut, self.ckpt_dir, self.step, self.tmp, self.final = fut, ckpt_dir, step, tmp, final
        self.ctx, self.meta, self.keep_last = ctx, meta, keep_last
        self.written_at = self.published_at = None  # time.perf_counter() stamps, set by the thread
        self.waited_s = 0.0  # how long the training thread blocked in ``wait``
        self.error: BaseException | None = None
        self._done = threading.Event()
        # daemon: a process that dies with a publish in flight leaves .tmp-step-N, as a SIGKILL would
        threading.Thread(target=self._run, name=f"tandem-publish-{step}", daemon=True).start()

    def _run(self) -> None:
        try:
            self.fut.result()
            self.written_at = time.perf_counter()
            if self.ctx.is_main:
                publish_files(self.ckpt_dir, self.step, self.tmp, self.final, self.meta, self.keep_last)
            self.published_at = time.perf_counter()
        except BaseException as e:  # handed to the training thread by poll/wait
            self.error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def poll(self) -> Path | None:
        """The published folder once the save is published (on rank 0; written, elsewhere), else None."""
        return self._result() if self._done.is_set() else None

    def wait(self) -> Path:
        t = time.perf_counter()
        self._done.wait()
        self.waited_s += time.perf_counter() - t
        return self._result()

    def _result(self) -> Path:
        if self.error is not None:
            raise CheckpointError(f"async save of {self.final.name} failed ({type(self.error).__name__}: "
                                  f"{self.error}); it was not published, and 'latest' still names the "
                                  f"previous checkpoint",
                                  field="checkpoint.dir", value=str(self.final.parent),
                                  fix="check free space and write permission there, then resume "
                                      "(checkpoint.resume=auto)") from self.error
        return self.final


def load(path: Path, model: nn.Module, optim: torch.optim.Optimizer, ctx: DistContext) -> CheckpointMeta:
    """Collective: restore model and optimizer (any world size), and RNG when the world matches."""
    meta = read_meta(path)
    dcp, opts, get_state_dict, set_state_dict = _dcp()
    model_sd, optim_sd = get_state_dict(model, _optim(optim), options=opts)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, _optim(optim), model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=opts)
    rng = Path(path) / f"rng-rank{ctx.rank}.pt"
    if meta.world_size == ctx.world and rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return meta
