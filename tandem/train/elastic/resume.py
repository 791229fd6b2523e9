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
  global batch, which W' x micro_batch divides).
* ``restart_report``: from the previous attempt's records in metrics.jsonl: steps
  redone, and the time lost = down (last progress -> new worker started: detection,
  teardown, rendezvous, spawn) + startup (imports, process group, checkpoint load).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tandem.core.errors import CheckpointError
from tandem.train import checkpoint as ckpt
from tandem.train import manifest


def run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def own_latest(ckpt_dir: Path) -> Path | None:
    rid = run_id()
    if not rid or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return None
    for p in reversed(ckpt.list_complete(Path(ckpt_dir))):
        try:
            meta = json.loads((p / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if meta.get("run_id") == rid and manifest.problem(p) is None:
            return p
    return None


def carry_position(meta: dict, world: int, log=print) -> int:
    """Samples this rank has consumed in the checkpoint's epoch, at the current world size."""
    c, old = int(meta.get("consumed", 0)), int(meta.get("world_size", world))
    if old == world:
        return c
    done = c * old
    if done % world:
        raise CheckpointError(f"the epoch position ({done} samples done at world {old}) does not divide by the "
                              f"new world size {world}", field="launch.nnodes", value=world,
                              fix="checkpoint at step boundaries (checkpoint.every_steps) with a global batch "
                                  "that every allowed world size divides")
    log(f"world size changed {old} -> {world}: data position carried over ({done} samples of epoch "
        f"{meta.get('epoch')} done: {c} per rank before, {done // world} per rank now)", flush=True)
    return done // world


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc; now as a fallback)."""
    import time

    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(l.split()[1]) for l in Path("/proc/stat").read_text().splitlines() if l.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return time.time()


def previous_attempt(records: list[dict]) -> dict | None:
    """The last step record before this start, if an earlier attempt of this run made progress."""
    if not any(r["kind"] == "start" for r in records):
        return None
    steps = [r for r in records if r["kind"] == "step"]
    starts = [r for r in records if r["kind"] == "start"]
    return {"last_step": steps[-1]["step"] if steps else starts[-1].get("start_step", 0),
            "last_time": steps[-1]["time"] if steps else starts[-1]["time"], "attempts": len(starts)}


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
    for p in (Path(run_dir) / "watchdog").glob("hang-*.json"):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec["detected_at"] >= after:
            found.append(rec)
    return min(found, key=lambda r: r["detected_at"]) if found else None
