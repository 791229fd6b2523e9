"""What a (re)started worker group resumes from, and what the restart cost.

* ``own_latest``: after torchrun restarts the group (TORCHELASTIC_RESTART_COUNT > 0: a
  failure with ``max_restarts`` left, which is also how survivors see a lost node), the
  newest checkpoint this run wrote (same TORCHELASTIC_RUN_ID, complete, matching its
  manifest) wins over the spec's ``checkpoint.resume``: a restart never goes back to the
  run's starting point. (A node that joins later, at restart count 0, follows the spec:
  with the default ``resume = "auto"`` that is the same checkpoint.)
* ``carry_position``: checkpoints store the samples each rank consumed in the epoch.
  Rank r of W takes positions r, r+W, ... of the epoch's shuffled list, so c per rank
  means the first c*W positions are done, whatever W is; a new world W' continues at
  c*W / W' per rank. No sample is skipped or repeated (c*W is a multiple of the
  global batch, which W' x micro_batch divides; under scale_lr validate checks that every
  allowed world divides every allowed global batch).
* ``plan_resize``: the batch arithmetic against the checkpoint's world (elastic.on_resize):
  keep_batch recomputes the accumulation; scale_lr keeps micro x accum, so the global
  batch follows the world, and the LR follows the global batch (``Schedule.resize``).
* ``restart_report``: from the previous attempt's records in metrics.jsonl: steps
  redone, and the time lost = down (last progress -> new worker started: detection,
  teardown, rendezvous, spawn) + startup (imports, process group, checkpoint load).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.core import rundir
from tandem.core.contract import AGENT_STARTS_ENV, ATTEMPT_ENV, attempt, run_id  # noqa: F401 (re-exported)
from tandem.core.errors import CheckpointError
from tandem.train import checkpoint as ckpt
from tandem.train import checkpoint_meta, manifest
from tandem.train.checkpoint_meta import CheckpointMeta


def agree_attempt(ctx) -> int:
    """torchrun does not count a restart for new nodes as a restart (TORCHELASTIC_RESTART_COUNT
    stays), and a joining agent starts at 0: each agent counts its own worker starts
    (TANDEM_AGENT_STARTS, set by the launcher's log specs), and the group takes the maximum,
    so every rank of a group names the same attempt and a later group a larger one."""
    import torch
    import torch.distributed as dist

    mine = max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get(AGENT_STARTS_ENV, "0")))
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([mine], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        mine = int(t.item())
    os.environ[ATTEMPT_ENV] = str(mine)
    return mine


def own_latest(ckpt_dir: Path) -> Path | None:
    rid = run_id()
    if not rid or attempt() == 0:
        return None
    for p in reversed(ckpt.list_complete(Path(ckpt_dir))):
        try:
            meta = checkpoint_meta.read(p)
        except (OSError, json.JSONDecodeError, CheckpointError):
            continue
        if meta.run_id == rid and manifest.problem(p) is None:
            return p
    return None


def checkpoint_dir(spec, run_dir: Path) -> Path:
    return Path(spec.checkpoint.dir) if spec.checkpoint.dir else Path(run_dir) / rundir.CHECKPOINTS


def resume_path(spec, run_dir: Path) -> Path | None:
    """The checkpoint a (re)started job loads: a restarted group's own newest, else per
    ``checkpoint.resume`` (auto: the newest complete one in the folder)."""
    own = own_latest(checkpoint_dir(spec, run_dir))
    if own is not None:
        return own
    r = spec.checkpoint.resume
    if r == "none":
        return None
    if r == "auto":
        return ckpt.latest(checkpoint_dir(spec, run_dir))
    return Path(r)


def layout_of(spec) -> dict:
    """How the weights are split: a checkpoint records it, a rerun compares it (train/run.py)."""
    p = spec.parallel
    return {"strategy": "zero3" if p.strategy == "fsdp" else p.strategy, "tp": p.tp, "pp": p.pp, "cp": p.cp,
            "ep": p.ep}


def schedule_key(spec) -> dict:
    """The fields that decide a run's length: a checkpoint at its total with the same ones is a finished run."""
    s = spec.schedule
    return {"epochs": s.epochs, "max_steps": s.max_steps, "global_batch": s.global_batch,
            "micro_batch": s.micro_batch}


def carry_position(meta: CheckpointMeta, world: int, log=print) -> int:
    """Samples this rank has consumed in the checkpoint's epoch, at the current data world size."""
    c, old = meta.consumed, meta.data_world if meta.data_world is not None else world
    if old == world:
        return c
    done = c * old
    if done % world:
        raise CheckpointError(f"the epoch position ({done} samples done at world {old}) does not divide by the "
                              f"new world size {world}", field="launch.nnodes", value=world,
                              fix="checkpoint at step boundaries (checkpoint.every_steps) with a global batch "
                                  "that every allowed world size divides")
    log(f"world size changed {old} -> {world}: data position carried over ({done} samples of epoch "
        f"{meta.epoch} done: {c} per rank before, {done // world} per rank now)", flush=True)
    return done // world


@dataclass(kw_only=True)
class Resize:
    """This start's batch arithmetic; ``old_*`` describe the checkpoint it resumes (if any)."""
    mode: str           # elastic.on_resize
    world: int          # data-parallel ranks now
    accum: int
    global_batch: int
    ratio: float        # global batch / configured one: the LR multiplier and the schedule's pace
    old_world: int | None = None
    old_accum: int | None = None
    old_global: int | None = None

    @property
    def changed(self) -> bool:
        return self.old_world is not None and (self.old_world, self.old_global) != (self.world, self.global_batch)

    def record(self) -> dict:
        return {"on_resize": self.mode, "old_world": self.old_world, "new_world": self.world,
                "old_global_batch": self.old_global, "new_global_batch": self.global_batch,
                "old_grad_accum": self.old_accum, "new_grad_accum": self.accum, "lr_scale": self.ratio}


def plan_resize(spec, meta: CheckpointMeta | None, world: int) -> Resize:
    from tandem.core.validate import grad_accum

    s, mode = spec.schedule, spec.elastic.on_resize
    if meta is None:
        accum = grad_accum(spec, world)
        return Resize(mode=mode, world=world, accum=accum, global_batch=s.global_batch, ratio=1.0)
    old_world = meta.data_world if meta.data_world is not None else world
    # checkpoints before on_resize recorded no batch: it was the configured one
    old_global = meta.global_batch if meta.global_batch is not None else s.global_batch
    old_accum = meta.grad_accum or max(1, old_global // (old_world * s.micro_batch))
    accum = old_accum if mode == "scale_lr" else grad_accum(spec, world)
    g = world * s.micro_batch * accum
    return Resize(mode=mode, world=world, accum=accum, global_batch=g, ratio=g / s.global_batch,
                  old_world=old_world, old_accum=old_accum, old_global=old_global)


def steps_left(spec, epoch: int, pos: int, epoch_len: int, per_step: int, steps_per_epoch: int,
               sched_pos: float, ratio: float) -> int:
    """Optimizer steps to the end of the run from (epoch, pos) at the current batch. With a
    global batch off the configured one, max_steps counts configured-batch steps (samples)."""
    s = spec.schedule
    left = 0
    if epoch < s.epochs:
        left = -(-(epoch_len - pos) // per_step) + (s.epochs - epoch - 1) * steps_per_epoch
    if s.max_steps:
        left = min(left, max(0, math.ceil((s.max_steps - sched_pos) / ratio - 1e-9)))
    return left


def describe_resize(rz: Resize, micro: int, step: int, old_peak: float, new_peak: float, lr_now: float,
                    pos: float, horizon: float, left: int) -> str:
    head = f"world size changed {rz.old_world} -> {rz.world} data ranks, on_resize = {rz.mode}: "
    if rz.mode == "keep_batch":
        return (head + f"global batch {rz.global_batch} kept = {rz.world} x micro {micro} x accum {rz.accum} "
                f"(accum was {rz.old_accum}); LR unchanged (peak {new_peak:g}, now {lr_now:.4g})")
    return (head + f"micro {micro} x accum {rz.accum} kept, global batch {rz.old_global} -> {rz.global_batch}; "
            f"LR x {rz.global_batch}/{rz.old_global} (linear scaling rule): peak {old_peak:g} -> {new_peak:g}, "
            f"now {lr_now:.4g}; schedule continues at step {step} (position {pos:g} of {horizon:g} steps of "
            f"the configured batch), {left} steps left")


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc; now as a fallback)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(l.split()[1]) for l in Path("/proc/stat").read_text().splitlines() if l.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return time.time()


def previous_attempt(records: list[dict], beats: list[dict] = ()) -> dict | None:
    """The last progress before this start, if an earlier attempt of this run made some.

    From the step records, and from the heartbeats the earlier attempt left (a step's
    record is written when the next step ends, with its all-reduced loss, so the
    heartbeat can be one step ahead)."""
    if not any(r["kind"] == "start" for r in records):
        return None
    steps = [r for r in records if r["kind"] == "step"]
    starts = [r for r in records if r["kind"] == "start"]
    last_step = steps[-1]["step"] if steps else starts[-1].get("start_step", 0)
    last_time = steps[-1]["time"] if steps else starts[-1]["time"]
    for b in beats:  # only beats newer than the records: a rank gone since an older attempt keeps its old beat
        t = b.get("step_time", b["time"])
        if b.get("run_id") == run_id() and b.get("attempt", 0) < attempt() and b["step"] > last_step and t >= last_time:
            last_step, last_time = b["step"], t
    return {"last_step": last_step, "last_time": last_time, "attempts": len(starts)}


def restart_report(prev: dict, resumed_step: int, proc_start: float, first_step_time: float,
                   step_s: float, hang: dict | None) -> dict:
    down = max(0.0, proc_start - prev["last_time"])
    startup = max(0.0, first_step_time - step_s - proc_start)
    rep = {"restart": prev["attempts"], "resumed_step": resumed_step, "last_step_before": prev["last_step"],
           "steps_redone": max(0, prev["last_step"] - resumed_step), "down_s": round(down, 2),
           "startup_s": round(startup, 2), "lost_s": round(down + startup, 2)}
    if hang:
        rep["detected_by"] = "watchdog"
        rep["detection_s"] = round(hang["detected_at"] - prev["last_time"], 2)
        rep["hang_first_rank"] = hang["first_stopped_rank"]
    return rep


def last_hang(run_dir: Path, after: float) -> dict | None:
    found = []
    for p in (Path(run_dir) / rundir.WATCHDOG).glob("hang-*.json"):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec["detected_at"] >= after:
            found.append(rec)
    return min(found, key=lambda r: r["detected_at"]) if found else None
