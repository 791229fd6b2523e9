"""Fault tolerance: the one object the trainer calls for it (so the loop stays readable).

    el = FaultTolerance(spec, ctx, run_dir, metrics, log)    # cleans partial saves, reads the last attempt
    sampler_for_loader = el.trace(sampler)                 # counts samples (TANDEM_TRACE_SAMPLES=1), slow faults
    el.before_sync(step)                                   # heartbeat: about to enter the gradient all-reduce
    el.on_step(step, epoch, dt, data_s, sync_s)            # heartbeat, stragglers, async save record, restart report
    path = el.save(ckdir, step, model, optim, meta)        # sync or async (checkpoint.async_save)
    if el.stop_here(flag_sum, step, periodic): save; raise el.stopped(step, path)  # SIGTERM: agreed stop
    el.finish() / el.summary()                             # wait for the last async save; restarts for result.json
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.core import contract, rundir
from tandem.core.heartbeat import Heartbeat, read_all
from tandem.core.runlock import process_start
from tandem.train import checkpoint as ckpt
from tandem.train.checkpoint_meta import CheckpointMeta
from tandem.train.elastic import faults
from tandem.train.elastic import resume as rs
from tandem.train.elastic.stop import Stopped, StopRequest
from tandem.train.elastic.straggler import StragglerMonitor

TRACE_ENV = "TANDEM_TRACE_SAMPLES"


class _TracedSampler:
    """Wraps the sampler the DataLoader draws from: records indices, applies 'slow' faults."""

    def __init__(self, sampler, owner: "FaultTolerance", batch: int) -> None:
        self.sampler, self.owner, self.batch = sampler, owner, batch

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for i, idx in enumerate(self.sampler):
            if i % self.batch == 0:
                faults.delay(self.owner.ctx.rank)
            if self.owner.tracing:
                self.owner.drawn.append(int(idx))
            yield idx


class FaultTolerance:
    def __init__(self, spec, ctx, run_dir: Path, metrics, log, ckdir: Path) -> None:
        self.spec, self.ctx, self.run_dir, self.metrics, self.log = spec, ctx, Path(run_dir), metrics, log
        self.attempt = rs.attempt()  # the group's attempt (a joined node included), see resume.agree_attempt
        self.proc_start = rs.process_start_time()
        self.hb = Heartbeat(self.run_dir, ctx.rank, ctx.local_rank)
        if getattr(getattr(spec, "launch", None), "watchdog_s", 0):
            why = contract.serve()  # torch's worker server: the watchdog reads the flight recorder through it
            if why:
                log(f"hang dumps will lack the flight recorder: {why}", flush=True)
        el = getattr(spec, "elastic", None)
        self.stop = StopRequest(getattr(el, "save_on_term", False) and dist.is_initialized(),
                                getattr(el, "term_grace_s", 10.0), peer_gone=self.peer_gone)
        self.straggler = StragglerMonitor(ctx, metrics, log, getattr(el, "straggler_every", 0),
                                          getattr(el, "straggler_ratio", 1.5), getattr(el, "straggler_min_ms", 10.0))
        self.before = rundir.read_metrics(self.run_dir) if ctx.is_main else []
        self.prev = rs.previous_attempt(self.before, read_all(self.run_dir) if ctx.is_main else [])
        self.report: dict | None = None
        self.tracing = os.environ.get(TRACE_ENV) == "1"
        self.drawn: list[int] = []
        self._trace_f = None
        if self.tracing:
            d = self.run_dir / rundir.SAMPLES
            d.mkdir(parents=True, exist_ok=True)
            self._trace_f = open(d / f"rank-{ctx.rank}.attempt{self.attempt}.jsonl", "w")
        self.pending = None
        self.pg = None
        if getattr(spec.checkpoint, "async_save", False) and dist.is_initialized():
            # DCP's background thread gets a group of its own; the name labels it in hang dumps
            self.pg = dist.new_group(backend="gloo", group_desc="async_checkpoint")
        if ctx.is_main:
            gone = ckpt.clean_partial(ckdir)
            if gone:
                log(f"removed partial checkpoint(s) of a save that did not finish: {', '.join(gone)}", flush=True)
                metrics.write("ckpt_cleaned", folders=gone)
        self.resumed_step = 0

    def peer_gone(self) -> str | None:
        """A rank of this group on this host whose process is gone (its heartbeat page names its
        pid): then no step can be agreed, and a stop signal must not wait for one (stop.py)."""
        me = self.hb.base
        for b in read_all(self.run_dir):
            if (b.get("rank") == self.ctx.rank or b.get("host") != me["host"] or b.get("run_id") != me["run_id"]
                    or b.get("attempt") != me["attempt"]):
                continue
            if process_start(int(b["pid"])) is None:
                return f"rank {b['rank']} (pid {b['pid']}) is gone"
        return None

    # -- the loop --------------------------------------------------------------------------------
    def trace(self, sampler):
        return _TracedSampler(sampler, self, self.spec.schedule.micro_batch)

    def resumed(self, path: Path, step: int) -> None:
        self.resumed_step = step
        for p, why in ckpt.SKIPPED.items():
            self.log(f"checkpoint {Path(p).name} refused: {why}; resumed from {Path(path).name} instead", flush=True)
            self.metrics.write("ckpt_refused", path=p, why=why, used=str(path))

    def before_sync(self, step: int) -> None:
        self.hb.beat(step, "sync")

    def pause(self, phase: str) -> None:
        """Leaving the step loop for a while (eval, done): neither the watchdog nor a SIGTERM's
        deadline judges it."""
        self.hb.beat(self.hb.step, phase)
        self.stop.progress(busy=True)

    def on_step(self, step: int, epoch: int, dt: float, data_s: float, sync_s: float) -> None:
        self.hb.beat(step, "step")
        self.stop.progress()
        if self._trace_f:
            self._trace_f.write(json.dumps({"step": step, "epoch": epoch, "idx": self.drawn}) + "\n")
            self._trace_f.flush()
            self.drawn = []
        self.straggler.record(step, max(0.0, dt - sync_s), data_s)
        if self.pending is not None and (path := self.pending.poll()) is not None:
            self._published(path)
        if self.prev is not None and self.report is None and self.ctx.is_main:
            hang = rs.last_hang(self.run_dir, self.prev["last_time"] - 1)
            self.report = rs.restart_report(self.prev, self.resumed_step, self.proc_start, time.time(), dt, hang)
            self.metrics.write("restart", **self.report)
            r = self.report
            self.log(f"restart {r['restart']}: resumed at step {r['resumed_step']} (the failed attempt reached "
                     f"step {r['last_step_before']}: {r['steps_redone']} step(s) redone); back to training "
                     f"{r['lost_s']:.1f} s after the last progress (down {r['down_s']:.1f} s + startup and "
                     f"reload {r['startup_s']:.1f} s)", flush=True)
        faults.point("step", step=step, rank=self.ctx.rank)

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, ckdir: Path, step: int, model, optim, meta: CheckpointMeta):
        """The published folder (sync), or None while an async save is in flight."""
        self.hb.beat(step, "save")  # before the wait below: a slow previous publish is not a hang
        self.stop.progress(busy=True)  # a SIGTERM's deadline does not run during a save
        if self.pending is not None:  # one save in flight: DCP's group and the folder rules allow one
            self._published(self.pending.wait())
        t0 = time.perf_counter()
        out = ckpt.save(ckdir, step, model, optim, self.ctx, meta, self.spec.checkpoint.keep_last,
                        async_pg=self.pg)
        if isinstance(out, ckpt.PendingSave):
            out.t0, out.staged_s = t0, time.perf_counter() - t0
            self.pending = out
            return None
        return out

    def _published(self, path: Path) -> None:
        """On the training thread, once the publish thread finished (seen by poll) or after a wait.
        A save's blocking time is its staging copy plus any wait for its publish (at the next save
        or at the end); the hashing and renaming ran in the background."""
        p, self.pending = self.pending, None
        rec = {"step": p.step, "path": str(path), "save_s": p.published_at - p.t0, "block_s": p.staged_s + p.waited_s,
               "stage_s": p.staged_s, "wait_s": p.waited_s, "written_s": p.written_at - p.t0,
               "publish_s": p.published_at - p.written_at, "mode": "async"}
        self.metrics.write("ckpt", **rec)
        self.log(f"checkpoint {path.name}: training blocked {rec['block_s'] * 1e3:.0f} ms (async save: staging "
                 f"{p.staged_s * 1e3:.0f} ms + waiting for the publish {p.waited_s * 1e3:.0f} ms); written after "
                 f"{rec['written_s']:.2f} s, hashed and published in the background after {rec['save_s']:.2f} s",
                 flush=True)
        self.last_published = path

    def stop_here(self, flag_sum: float, step: int, saved: bool) -> bool:
        """After a step whose summed SIGTERM flag is ``flag_sum`` (the same on every rank): when
        some rank was told to stop, log it; the trainer then saves (``saved``: a periodic save
        of this step does it anyway) and raises ``stopped``."""
        if not self.stop.agreed(flag_sum):
            return False
        self.hb.beat(step, "save")
        if self.ctx.is_main:
            self.log(f"stop signal (SIGTERM/SIGINT) on {int(flag_sum)} rank(s): the group stops after step {step}"
                     f"{'' if saved else ', with a checkpoint there'}", flush=True)
        return True

    def stopped(self, step: int, path: Path | None) -> Stopped:
        """The exception that ends every rank once the stop checkpoint is published."""
        path = self.finish() or path
        first = self.stop.signal_time or float("inf")
        if dist.is_initialized():  # the first signal, wherever it landed (rank 0 may not have had one)
            t = torch.tensor([first], dtype=torch.float64, device=self.ctx.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            first = float(t)
        waited = time.time() - first
        self.metrics.write("stop", step=step, checkpoint=str(path) if path else None, after_signal_s=waited)
        if self.ctx.is_main:
            self.log(f"stopped at step {step}: checkpoint {Path(path).name if path else '(none)'} "
                     f"{waited:.1f} s after the first stop signal", flush=True)
        name = signal.Signals(self.stop.signum).name if self.stop.signal_time else "a peer's signal"
        return Stopped(f"stopped on {name} at step {step}: checkpoint {path} saved, to resume from without "
                       f"redoing a step")

    def finish(self) -> Path | None:
        """Wait for an async save in flight; its folder, if there was one."""
        self.pause("done")
        self.stop.close()
        if self.pending is None:
            return None
        self._published(self.pending.wait())
        return self.last_published

    def summary(self) -> dict:
        restarts = [{k: v for k, v in r.items() if k not in ("kind", "time")}
                    for r in self.before if r["kind"] == "restart"]
        if self.report:
            restarts.append(self.report)
        if restarts and self.ctx.is_main:
            lost = sum(r["lost_s"] for r in restarts)
            redone = sum(r["steps_redone"] for r in restarts)
            self.log(f"survived {len(restarts)} restart(s): {lost:.1f} s lost in all, {redone} step(s) redone",
                     flush=True)
        return {"restarts": restarts, "stragglers": self.straggler.flagged}
