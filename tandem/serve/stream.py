"""The pool's side of continuous batching: keep a replica's running batch full.

A sender takes requests from the shared queue whenever the replica has a free slot (no waiting for a
batch to fill: the replica adds a request at its next decode step) and sends each as its own frame; a
reader matches the replica's replies to requests by id, in whatever order they finish. Each finished
request frees a slot at once. A replica that dies, or that has requests and sends nothing back for the
hang timeout, is killed; every request it held goes back to the head of the queue (inference is
idempotent) and the pool restarts it (pool.py).

The pool owns the queue and the replicas and calls ``serve_continuous(pool, rep)`` for each replica
that batches continuously; this module takes from the pool only what engine.Feed declares (the queue
and its condition, the options, metrics and ``say``, ``closing``, ``retired(slot)``, ``requeue(work)``
and ``hold(rep, now)``), and does not import pool.py. What both batchers send and read is in work.py.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time

import numpy as np

from tandem.serve import messages as M
from tandem.serve.engine import Feed
from tandem.serve.work import DeadlineExceeded, Replica, ReplicaError, RequestFailed, Work


async def serve_continuous(pool: Feed, rep: Replica) -> None:
    """Feed ``rep`` until it dies, the pool closes, or its slot is retired (then after its last reply)."""
    inflight: dict[int, Work] = {}
    # id -> (tokens decoded, when that count last grew): a request whose count stays put for --hang-s
    # while the replica answers others is lost inside it (the replica's {"held"} heartbeats say how far
    # each request it holds has got; one it lost is not among them)
    prog: dict[int, tuple[int, float]] = {}
    ids = itertools.count()
    state = {"dead": False, "progress": time.monotonic()}   # progress: the replica's last frame of any kind

    async def wake() -> None:
        async with pool.cond:
            pool.cond.notify_all()

    async def reader() -> None:
        try:
            while True:
                reply = await M.read_reply(rep.proc.stdout)
                now = state["progress"] = time.monotonic()
                if isinstance(reply, M.Held):     # a heartbeat: alive, and each held request's token count
                    for key, n in reply.held.items():
                        _advance(prog, int(key), int(n), now)
                    continue
                if isinstance(reply, M.Tokens):   # a streamed request's new tokens: it stays in flight
                    w = inflight.get(reply.id)
                    _advance(prog, reply.id, reply.at + len(reply.tokens), now)
                    if w is not None and w.sink is not None and not w.future.done():
                        w.sink.on_tokens(reply.tokens, reply.at)
                    continue
                rid = getattr(reply, "id", None)
                prog.pop(rid, None)
                w = inflight.pop(rid, None)
                if isinstance(reply, M.Outputs) and reply.cancelled:
                    pool.m.llm.cancelled.inc()
                    pool.m.llm.cancelled_tokens.inc(len(reply.outputs))
                if w is not None:
                    _answer(pool, w, reply)
                rep.load = _load(inflight)
                pool.hold(rep, bool(inflight))
                await wake()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, TypeError, OSError) as e:
            state["dead"] = True
            rep.load = pool.o.max_batch   # full: least-loaded routing no longer counts it as a taker
            if inflight:
                pool.say(f"serve: replica {rep.slot} (pid {rep.pid}) lost {len(inflight)} request(s) "
                         f"({type(e).__name__}); retrying them on another replica")
                pool.m.retries.inc()
            await _requeue(pool, list(inflight.values()))
            inflight.clear()
            pool.hold(rep, False)
            await wake()

    async def watchdog() -> None:
        """A replica that holds requests and sends nothing within the hang timeout is hung: kill it. One
        that is alive but has decoded no token of a request for the hang timeout has lost that request:
        answer it alone (500, not retried: another replica could lose it the same way), and tell the
        replica to drop it, should it still hold it somewhere."""
        hang = pool.o.hang_s
        while True:
            await asyncio.sleep(heartbeat_s(hang))
            now = time.monotonic()
            if inflight and now - state["progress"] > hang:
                pool.say(f"serve: replica {rep.slot} (pid {rep.pid}) answered nothing in {hang:g} s; killing it")
                rep.kill()
                return
            for k, (n, t) in list(prog.items()):
                w = inflight.get(k)
                if w is None:
                    prog.pop(k)
                elif now - t > hang:
                    prog.pop(k)
                    del inflight[k]
                    pool.say(f"serve: replica {rep.slot} (pid {rep.pid}) decoded no token of request {w.rid} in "
                             f"{hang:g} s while it answered others ({n} token(s) before); answering it 500")
                    pool.m.given_up.labels("lost").inc()
                    if not w.future.done():
                        w.future.set_exception(RequestFailed(w.rid, f"its replica decoded no token of it in {hang:g} s "
                                                                    f"(--hang-s) while it served others; not retried"))
                    _send_cancel(rep, k)
                    rep.load = _load(inflight)
                    pool.hold(rep, bool(inflight))
                    await wake()

    tasks = [asyncio.create_task(reader()), asyncio.create_task(watchdog())]
    try:
        while True:
            batch = await _take(pool, rep, inflight, state)
            if batch is None:
                break
            if not batch:
                continue
            if not inflight:
                state["progress"] = time.monotonic()   # the hang clock starts with the first request held
            now = time.monotonic()
            for w in batch:
                k = next(ids)
                inflight[k] = w
                prog[k] = (0, now)
                if w.kind == "predict":
                    x = np.ascontiguousarray(w.payload)
                    msg = M.Predict(list(x.shape), x.dtype.name, id=k, raw=x.tobytes())
                else:
                    msg = M.Join(k, w.payload, stream=w.sink is not None)
                    if w.sink is not None:   # tokens back step by step; a cancelled future leaves the batch
                        w.future.add_done_callback(functools.partial(_cancel, rep, k))
                        w.sink.on_started()
                rep.proc.stdin.write(M.encode(msg))
            pool.m.batch_size.labels(batch[0].kind).observe(sum(w.size for w in inflight.values()))
            try:
                await rep.proc.stdin.drain()
            except (ConnectionError, OSError):
                pass   # the reader sees the replica go and requeues what it held
        while inflight and not state["dead"] and not pool.closing:   # retired: let the last ones finish
            async with pool.cond:
                await pool.cond.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        rep.load = pool.o.max_batch   # gone or retired: it takes nothing more
        if inflight:
            await _requeue(pool, list(inflight.values()))
        pool.hold(rep, False)


def heartbeat_s(hang_s: float) -> float:
    """How often a continuous replica says it is alive (and the watchdog looks): well inside --hang-s."""
    return min(1.0, hang_s / 4)


def _load(inflight: dict) -> int:
    return sum(w.size for w in inflight.values())


def _advance(prog: dict, k, n: int, now: float) -> None:
    p = prog.get(k)
    if p is not None and n > p[0]:
        prog[k] = (n, now)


def _cancel(rep: Replica, k: int, fut: asyncio.Future) -> None:
    """A streamed request's future was cancelled (client gone, stop sequence): the replica drops it
    before its next decode step and frees the slot (it answers the id once more, "cancelled")."""
    if fut.cancelled():
        _send_cancel(rep, k)


def _send_cancel(rep: Replica, k: int) -> None:
    if rep.proc.returncode is None:
        try:
            rep.proc.stdin.write(M.encode(M.Cancel(k)))
        except (ConnectionError, OSError, RuntimeError):
            pass   # the replica is going: the reader requeues or fails what it held


async def _requeue(pool: Feed, works: list[Work]) -> None:
    """Back to the queue, except streams that already sent tokens to their client: a retry would send
    them again, so they fail (the client sees an error event, not a silent truncation)."""
    for w in works:
        if w.sink is not None and not w.future.done() and w.sink.on_lost():
            w.future.set_exception(ReplicaError(f"the replica serving this stream died after "
                                                f"{w.sink.sent} token(s) were sent"))
    await pool.requeue([w for w in works if not w.future.done()])


async def _take(pool: Feed, rep: Replica, inflight: dict, state: dict) -> list[Work] | None:
    """Requests for the replica's free slots, at once (the oldest first), while no other replica with a
    free slot holds fewer (``pool.least_loaded``); None when it should stop."""
    async with pool.cond:
        while True:
            if state["dead"] or rep.proc.returncode is not None or pool.closing or pool.retired(rep.slot):
                return None
            rep.load = _load(inflight)
            room = pool.o.max_batch - rep.load
            if pool.queue and room > 0 and not pool.least_loaded(rep):
                pool.cond.notify_all()   # a less loaded replica takes it (it may be waiting)
            elif pool.queue and room > 0:
                if inflight:
                    break
                # an idle replica starts its batch like a static one: the oldest request waits at most
                # --batch-wait-ms for others to fill it; later ones join the running batch at once
                left = pool.queue[0].t_enq + pool.o.batch_wait_ms / 1000 - time.monotonic()
                if left <= 0 or sum(w.size for w in pool.queue) >= room:
                    break
                try:
                    await asyncio.wait_for(pool.cond.wait(), left)
                except asyncio.TimeoutError:
                    pass
                continue
            await pool.cond.wait()
        batch, now = [], time.monotonic()
        while pool.queue and pool.queue[0].size <= room and (not batch or pool.least_loaded(rep)):
            w = pool.queue.popleft()
            if w.future.done():
                continue
            if w.expired(now):  # past its deadline: dropped before the model sees it
                w.future.set_exception(DeadlineExceeded(f"timeout_ms {w.timeout_ms} passed before a replica "
                                                        f"took the request"))
                continue
            batch.append(w)
            room -= w.size
            rep.load += w.size
        if pool.queue and batch:
            pool.cond.notify_all()   # what is left may be another replica's to take
        pool.m.queue_depth.set(len(pool.queue))
        pool.hold(rep, bool(inflight or batch))
        return batch


def _answer(pool: Feed, w: Work, reply: M.Reply) -> None:
    if w.future.done():
        return
    if isinstance(reply, M.Error):
        w.future.set_exception(RequestFailed(w.rid, reply.error))
    elif isinstance(reply, M.Array):
        w.future.set_result(np.frombuffer(reply.raw, dtype="<f4").reshape(reply.shape))
    elif isinstance(reply, M.Outputs):
        pool.m.tokens.inc(len(reply.outputs))
        w.future.set_result(reply.outputs)
    else:
        w.future.set_exception(RequestFailed(w.rid, f"unexpected reply {type(reply).__name__}"))
