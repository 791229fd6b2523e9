"""The vllm engine's choice of replica, without vLLM: a replica whose API server refuses connections is out
of the pick at once, and a retry never goes back to a replica that already lost the request (a SIGKILLed
replica stays in the pool's list until its exit is reaped; sent back there, the retry counted a second death
and the request was answered 500 in a CI run of test_vllm_engine's kill-under-load test).

The replicas' processes are real (``sleep``), their ports real loopback ports with nothing listening.
"""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from tandem.serve.metrics import Metrics
from tandem.serve.pool import PoolOptions
from tandem.serve.vllm_engine import VllmOptions, VllmPool, VllmReplica, _free_port, _Lost


async def _replica(slot: int, log) -> VllmReplica:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    return VllmReplica(slot, proc, _free_port(), log)


async def _scenario(tmp_path) -> None:
    pool = VllmPool(PoolOptions(export=tmp_path, replicas=2, run_dir=tmp_path, hang_s=30.0), Metrics(),
                    VllmOptions(python=sys.executable))
    pool.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
    a, b = await _replica(0, tmp_path / "a.log"), await _replica(1, tmp_path / "b.log")
    try:
        pool.live = [a, b]
        b.inflight = 3
        assert await pool._pick(0.0, 0) is a                 # the least loaded first
        assert await pool._pick(0.0, 0, {a}) is b            # not back to one that lost this request
        with pytest.raises(_Lost, match="ConnectError"):
            await pool._run(a, {"prompt": [1, 2], "max_new_tokens": 2}, None, [], "r1")
        assert a.refused and a.proc.returncode is None and a.inflight == 0
        assert await pool._pick(0.0, 0) is b                 # refused: out of every pick, though its process lives

        # the only replica lost it: the retry waits for a new one, and takes it
        pool.live = [a, None]
        a.refused = False
        waiter = asyncio.create_task(pool._pick(time.monotonic(), 0, {a}))
        await asyncio.sleep(0)   # the pick is waiting now (the event loop ran it to its wait)
        assert not waiter.done() and pool.waiting == 1
        c = await _replica(0, tmp_path / "c.log")
        try:
            pool.live = [c, None]
            pool._changed.set()
            assert await asyncio.wait_for(waiter, 10) is c
        finally:
            c.proc.kill()
            await c.proc.wait()
    finally:
        for r in (a, b):
            r.proc.kill()
            await r.proc.wait()
        await pool.client.aclose()


def test_a_retry_skips_the_replicas_that_lost_it_and_those_that_refuse(tmp_path):
    asyncio.run(_scenario(tmp_path))
