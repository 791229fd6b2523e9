"""The replica pool: N replica processes, one bounded queue, batching, supervision, retry.

Each replica slot runs one coroutine: start the replica (replica.py), then repeatedly take a batch
from the shared queue and send it. A batch is the oldest waiting item plus items of the same kind
that arrive before it has waited --batch-wait-ms, up to --max-batch. A replica that exits, or sends
nothing back within the hang timeout, is killed; its batch goes back to the head of the queue for
whichever replica is free next (inference is idempotent), and the slot starts a new replica.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.serve.autoscale import Scaler, ScalePolicy, recent_p99_ms
from tandem.serve.engine import Engine, Feed
from tandem.serve.metrics import Metrics
from tandem.serve.stream import heartbeat_s, serve_continuous
from tandem.serve import messages as M
from tandem.serve.work import DeadlineExceeded, QueueFull, Replica, ReplicaError, RequestFailed, Work

STREAM_LIMIT = 64 << 20   # one reply line may hold a whole batch's outputs
# a request held by this many replicas that died is answered 500, not retried again: once is an outside
# kill (retried: 0 failed requests), twice is most likely the request itself killing replicas
MAX_DEATHS = 2


@dataclass
class PoolOptions:
    export: Path
    replicas: int = 1
    max_batch: int = 32
    batch_wait_ms: float = 5.0
    max_queue: int = 256
    run_dir: Path = Path("runs/serve")
    threads: int = 1
    hang_s: float = 60.0
    load_timeout_s: float = 300.0
    scale: ScalePolicy | None = None   # --replicas MIN:MAX (replicas is MIN then)
    continuous: bool = True   # GPT exports: iteration-level batching (stream.py); False: whole batches
    tp: int = 1               # processes per replica (tensor-parallel ranks of one model)
    step_tokens: int = 256    # continuous batching: tokens one decode step feeds at most (chunked prefill)


class Pool(Engine, Feed):
    """The local engine (engine.Engine), and the feed of its continuous batchers (engine.Feed)."""

    def __init__(self, opts: PoolOptions, metrics: Metrics, say=print):
        self.o, self.m, self.say = opts, metrics, say
        self.queue: deque[Work] = deque()
        self.cond = asyncio.Condition()
        size = max(opts.replicas, opts.scale.max_replicas if opts.scale else 0)
        self.active = opts.replicas      # slots 0..active-1 run a replica; autoscaling moves this
        self.live: list[Replica | None] = [None] * size    # serving now
        self.procs: list[Replica | None] = [None] * size   # started, ready or not (to stop on close)
        self.restarts = [0] * size
        self.loading: set[int] = set()   # slots whose replica is starting
        self.busy = 0                    # replicas holding a batch now
        self.closing = False
        self.draining = False            # SIGTERM: replicas that die are not restarted, none is added
        self.outstanding: set[Work] = set()   # submitted and not yet answered (abort answers them)
        # set when a slot's first replica serves (or cannot start); autoscaled slots start set
        self._first_ready = [asyncio.Event() for _ in range(size)]
        for e in self._first_ready[opts.replicas:]:
            e.set()
        self._start_error: str | None = None
        self._tasks: list[asyncio.Task] = []
        # (answered at, seconds since admitted) of recent successes: the p99 signal of --scale-up-p99-ms
        self.recent: deque[tuple[float, float]] = deque(maxlen=20000)

    # ---- admission ----
    streams = True   # submit takes a sink: tokens come back one step at a time (continuous batching)

    async def submit(self, kind: str, payload, size: int, timeout_ms: int = 0, sink=None):
        if len(self.queue) >= self.o.max_queue:
            raise QueueFull()
        w = Work(kind, payload, size, asyncio.get_running_loop().create_future(), timeout_ms=timeout_ms, sink=sink)
        async with self.cond:
            self.queue.append(w)
            self.m.queue_depth.set(len(self.queue))
            self.cond.notify_all()
        self.outstanding.add(w)
        try:
            res = await w.future
        finally:
            self.outstanding.discard(w)
        now = time.monotonic()
        self.recent.append((now, now - w.t_enq))
        return res

    @property
    def ready_count(self) -> int:
        return sum(r is not None for r in self.live)

    def ready_pids(self) -> list[int]:
        return [r.pid for r in self.live if r is not None]

    def retired(self, slot: int) -> bool:
        return slot >= self.active

    def hold(self, rep: Replica, now: bool) -> None:
        """``busy`` counts replicas holding work (the autoscaler's "busy"); a replica counts once."""
        if now != rep.holding:
            self.busy += 1 if now else -1
            rep.holding = now

    def least_loaded(self, rep: Replica) -> bool:
        """engine.Feed: a request goes to the serving replica with a free slot that holds the fewest in
        flight. Without this the replica that is already busy took every new request first (its sender
        is the first to wake), and a second replica sat idle while the first ran full."""
        others = [r.load for r in self.live if r is not None and r is not rep and r.continuous
                  and r.proc.returncode is None and r.load < self.o.max_batch and not self.retired(r.slot)]
        return not others or rep.load <= min(others)

    def drain(self) -> None:
        """SIGTERM: from now on a replica that dies is not restarted and autoscaling adds none."""
        self.draining = True

    def abort(self, why: str) -> None:
        """Answer every request not yet answered (queued or on a replica) with ``why`` (a 503): the end
        of a drain. A replica's late reply for one of them is dropped (its future is done)."""
        for w in list(self.outstanding):
            if not w.future.done():
                w.future.set_exception(ReplicaError(why))
        self.queue.clear()
        self.m.queue_depth.set(0)

    # ---- lifecycle ----
    async def start(self) -> None:
        self.o.run_dir.mkdir(parents=True, exist_ok=True)
        self._tasks = [asyncio.create_task(self._slot(i)) for i in range(self.o.replicas)]
        waits = [asyncio.create_task(e.wait()) for e in self._first_ready[:self.o.replicas]]
        await asyncio.gather(*waits)
        if self._start_error:
            await self.close()
            raise ReplicaError(self._start_error)
        self.m.replicas_target.set(self.active)
        if self.o.scale:
            self._tasks.append(asyncio.create_task(self._autoscale(Scaler(self.o.scale))))

    async def _autoscale(self, scaler: Scaler) -> None:
        """Sample the queue every tick; act on the policy's decisions (autoscale.py)."""
        loop, sc = asyncio.get_running_loop(), self.o.scale
        shape, since = None, time.monotonic()
        while not self.closing:
            await asyncio.sleep(sc.tick_s)
            if self.draining:
                continue
            live = sum(r is not None for r in self.live[:self.active])
            now = time.monotonic()
            if (live, len(self.loading)) != shape:   # the p99 counts only requests the present pool answered
                shape, since = (live, len(self.loading)), now
            p99 = recent_p99_ms(self.recent, max(since, now - sc.p99_window_s))
            self.m.recent_p99.set(p99 / 1000 if p99 is not None else 0.0)
            d = scaler.observe(loop.time(), len(self.queue), self.busy, live, len(self.loading), p99)
            if d is None:
                continue
            self.say(f"autoscale: {d.before} -> {d.after} replica(s): {d.reason}")
            with open(self.o.run_dir / "autoscale.jsonl", "a") as f:
                f.write(json.dumps({"time": time.time(), "direction": d.direction, "before": d.before,
                                    "after": d.after, "reason": d.reason, "signal": d.signal,
                                    "queue_depth": len(self.queue), "p99_ms": p99}) + "\n")
            self.m.scale_decisions.labels(d.direction, d.signal).inc()
            if d.direction == "up":
                self.active += 1
                self._tasks.append(asyncio.create_task(self._slot(self.active - 1)))
            else:
                self.active -= 1   # the last slot finishes its batch, then stops its replica
                async with self.cond:
                    self.cond.notify_all()
            self.m.replicas_target.set(self.active)
            self._write_pids()

    async def close(self) -> None:
        self.closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(_stop(r) for r in self.procs if r is not None))
        while self.queue:
            w = self.queue.popleft()
            if not w.future.done():
                w.future.set_exception(ReplicaError("the server is shutting down"))

    async def _spawn(self, slot: int) -> Replica:
        log = self.o.run_dir / f"replica-{slot}.log"
        with open(log, "ab") as errf:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tandem.serve.replica", str(self.o.export), "--threads", str(self.o.threads),
                "--slots", str(self.o.max_batch if self.o.continuous else 0), "--tp", str(self.o.tp),
                "--step-tokens", str(self.o.step_tokens),
                "--heartbeat-s", str(heartbeat_s(self.o.hang_s)),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=errf, limit=STREAM_LIMIT)
        rep = self.procs[slot] = Replica(slot, proc, log)
        try:
            hello = await asyncio.wait_for(M.read_reply(proc.stdout), self.o.load_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError):
            hello = None
        if not isinstance(hello, M.Ready):
            await _ensure_dead(rep)
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise ReplicaError(f"replica {slot} failed to load and warm up (exit {proc.returncode}): {tail[0]}")
        rep.continuous, rep.tp_pids = hello.continuous, hello.tp_pids
        return rep

    async def _slot(self, slot: int) -> None:
        backoff = 0.5
        while not self.closing and not self.retired(slot):
            self.loading.add(slot)
            try:
                rep = await self._spawn(slot)
            except ReplicaError as e:
                if not self._first_ready[slot].is_set():  # a replica that cannot start at all: stop the server
                    self._start_error = str(e)
                    self._first_ready[slot].set()
                    return
                self.say(f"serve: {e}; retrying in {backoff:.1f} s")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            finally:
                self.loading.discard(slot)
            backoff = 0.5
            self.live[slot] = rep
            self.m.replicas_ready.set(self.ready_count)
            self._write_pids()
            self._first_ready[slot].set()
            watch = asyncio.create_task(self._watch(rep))
            try:
                if rep.continuous:
                    await serve_continuous(self, rep)
                else:
                    await self._serve(rep)
            finally:
                self.live[slot] = None
                self.m.replicas_ready.set(self.ready_count)
                watch.cancel()
            if self.closing:
                return
            if self.retired(slot) and rep.proc.returncode is None:   # scaled down: stopped, not restarted
                await _stop(rep)
                self.procs[slot] = None
                self.say(f"serve: replica {slot} (pid {rep.pid}) stopped (scaled down)")
                self._write_pids()
                return
            await _ensure_dead(rep)
            if self.draining:   # the server is going: what this replica held waits for the others, or the drain's end
                self.say(f"serve: replica {slot} (pid {rep.pid}) died (exit {rep.proc.returncode}) while draining; "
                         f"not restarted")
                self._write_pids()
                return
            self.restarts[slot] += 1
            self.m.restarts.inc()
            self.say(f"serve: replica {slot} (pid {rep.pid}) died (exit {rep.proc.returncode}); restarting")
            self._write_pids()

    # ---- batching ----
    async def _take(self, rep: Replica) -> list[Work] | None:
        """The next batch, or None when the replica died while waiting (its watcher wakes us)."""
        async with self.cond:
            while not self.queue:
                if rep.proc.returncode is not None or self.closing or self.retired(rep.slot):
                    return None
                await self.cond.wait()
            first = self.queue.popleft()
            batch, n = [first], first.size
            deadline = first.t_enq + self.o.batch_wait_ms / 1000
            while True:
                n = self._gather(batch, n, first.kind)
                left = deadline - time.monotonic()
                if n >= self.o.max_batch or left <= 0:
                    break
                try:
                    await asyncio.wait_for(self.cond.wait(), left)
                except asyncio.TimeoutError:
                    pass
            self.m.queue_depth.set(len(self.queue))
            return batch

    async def _watch(self, rep: Replica) -> None:
        """Wake the waiting slots when ``rep`` exits, so an idle replica's death is noticed at once."""
        await rep.proc.wait()
        async with self.cond:
            self.cond.notify_all()

    def _gather(self, batch: list[Work], n: int, kind: str) -> int:
        keep = deque()
        while self.queue:
            w = self.queue.popleft()
            if w.kind == kind and n + w.size <= self.o.max_batch:
                batch.append(w)
                n += w.size
            else:
                keep.append(w)
        self.queue.extendleft(reversed(keep))
        return n

    async def requeue(self, batch: list[Work]) -> None:
        async with self.cond:
            for w in reversed(batch):
                w.attempts += 1
                if w.future.done():
                    continue
                if w.attempts >= MAX_DEATHS:
                    self.say(f"serve: request {w.rid} was held by {w.attempts} replicas that died; answering it "
                             f"500, not retrying it")
                    self.m.given_up.labels("replicas_died").inc()
                    w.future.set_exception(RequestFailed(w.rid, f"{w.attempts} replicas died holding it; not "
                                                                f"retried (it may be what kills them)"))
                else:
                    self.queue.appendleft(w)
            self.m.queue_depth.set(len(self.queue))
            self.cond.notify_all()

    async def _serve(self, rep: Replica) -> None:
        """Send batches to ``rep`` until it dies (then return)."""
        while not self.closing and not self.retired(rep.slot):
            batch = await self._take(rep)
            if batch is None:
                return
            now = time.monotonic()
            for w in batch:  # past its deadline: dropped before the model sees it
                if w.expired(now) and not w.future.done():
                    w.future.set_exception(DeadlineExceeded(f"timeout_ms {w.timeout_ms} passed before a replica "
                                                            f"took the request"))
            batch = [w for w in batch if not w.future.done()]  # expired, or the client went away
            if not batch:
                continue
            kind = batch[0].kind
            if kind == "predict":
                x = np.ascontiguousarray(np.concatenate([w.payload for w in batch]))
                msg = M.Predict(list(x.shape), x.dtype.name, raw=x.tobytes())
            else:
                msg = M.Generate([w.payload for w in batch])
            self.m.batch_size.labels(kind).observe(sum(w.size for w in batch))
            self.busy += 1
            try:
                rep.proc.stdin.write(M.encode(msg))
                await rep.proc.stdin.drain()
                reply = await asyncio.wait_for(M.read_reply(rep.proc.stdout), self.o.hang_s)
            except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, TypeError,
                    OSError) as e:
                self.say(f"serve: replica {rep.slot} (pid {rep.pid}) lost a batch of {len(batch)} "
                         f"({type(e).__name__}); retrying it on another replica")
                self.m.retries.inc()
                if isinstance(e, asyncio.TimeoutError):  # hung: no batch back within the timeout
                    rep.kill()
                await self.requeue(batch)
                return
            finally:
                self.busy -= 1
            self._answer(batch, reply)

    def _answer(self, batch: list[Work], reply: M.Reply) -> None:
        if not isinstance(reply, (M.Array, M.Outputs)):   # an Error (or a frame that is no answer)
            why = reply.error if isinstance(reply, M.Error) else f"unexpected reply {type(reply).__name__}"
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(RequestFailed(w.rid, why))
            return
        if isinstance(reply, M.Array):
            outs = np.frombuffer(reply.raw, dtype="<f4").reshape(reply.shape)
        else:
            outs = reply.outputs
        errors = getattr(reply, "errors", None) or {}   # generate: the requests that failed alone
        i = 0
        for w in batch:
            if w.kind == "predict":
                res, i = outs[i:i + w.size], i + w.size
            else:
                res, i = outs[i], i + 1
                if str(i - 1) in errors:
                    if not w.future.done():
                        w.future.set_exception(RequestFailed(w.rid, errors[str(i - 1)]))
                    continue
                self.m.tokens.inc(len(res))
            if not w.future.done():
                w.future.set_result(res)

    def _write_pids(self) -> None:
        doc = {"front_pid": os.getpid(), "export": str(self.o.export),
               "replicas": [{"slot": i, "pid": r.pid if r else None, "ready": r is not None,
                             "restarts": self.restarts[i], "tp_pids": r.tp_pids if r else []}  # tp ranks 1..N-1
                            for i, r in enumerate(self.live[:self.active])]}
        path = self.o.run_dir / "replicas.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)


async def _ensure_dead(rep: Replica) -> None:
    """Let a replica whose pipe closed finish exiting (so asyncio reaps it and sees its real exit
    status); kill it if it is still there after 2 s."""
    try:
        await asyncio.wait_for(asyncio.shield(rep.proc.wait()), 2)
    except asyncio.TimeoutError:
        rep.kill()
        await rep.proc.wait()


async def _stop(rep: Replica) -> None:
    """Close the replica's stdin (it leaves its loop and exits); kill it if it does not within 5 s."""
    try:
        rep.proc.stdin.close()
        await asyncio.wait_for(rep.proc.wait(), 5)
    except (asyncio.TimeoutError, OSError):
        rep.kill()
        await rep.proc.wait()
