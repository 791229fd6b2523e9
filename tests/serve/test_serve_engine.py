"""The serving package's structure: the engines (local, Ray, vLLM) implement every member of the declared
Engine interface themselves (none falls back to the protocol's empty body), the pool implements the Feed
its continuous batcher reads (which does not import the pool), and every frame between front and replica
is a typed message that round-trips."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

from tandem.serve.engine import Engine, Feed
from tandem.serve.metrics import Metrics
from tandem.serve.pool import Pool, PoolOptions
from tandem.serve.ray_engine import RayPool
from tandem.serve.vllm_engine import VllmOptions, VllmPool

SERVE = Path(__file__).resolve().parents[2] / "tandem" / "serve"


def _members(proto) -> set[str]:
    return {n for n in proto.__dict__ if not n.startswith("_")} | set(proto.__annotations__)


def _defines(cls, obj, name: str) -> bool:
    """``name`` set on the instance, or defined by the class or a base that is not one of the protocols."""
    if name in vars(obj):
        return True
    owner = next((k for k in cls.__mro__ if name in vars(k)), None)
    return owner is not None and owner not in (Engine, Feed)


def test_engines_implement_the_interface_and_serve_has_no_import_cycle(tmp_path):
    opts = PoolOptions(export=tmp_path, run_dir=tmp_path)
    pool = asyncio.run(_make(Pool, opts))
    ray = RayPool(opts, Metrics())
    vllm = VllmPool(opts, Metrics(), VllmOptions(python="python"))
    for cls, obj, protos in ((Pool, pool, (Engine, Feed)), (RayPool, ray, (Engine,)), (VllmPool, vllm, (Engine,))):
        assert all(p in cls.__mro__ for p in protos)   # declared, not only shaped alike
        for p in protos:
            missing = [n for n in _members(p) if not _defines(cls, obj, n)]
            assert not missing, f"{cls.__name__} lacks {missing} of {p.__name__}"
        for n in _members(Engine):   # the calls take what the interface says
            proto_fn = getattr(Engine, n, None)
            if inspect.isfunction(proto_fn):
                assert list(inspect.signature(getattr(cls, n)).parameters) == \
                    list(inspect.signature(proto_fn).parameters), (cls.__name__, n)
    # the batcher reads the pool through Feed, never by importing it (tests/test_layering.py checks that no
    # files of the package import each other round a circle)
    stream = (SERVE / "stream.py").read_text()
    assert "tandem.serve.pool" not in stream and "engine import Feed" in stream


def test_every_frame_round_trips_through_its_typed_message():
    import json

    from tandem.serve import messages as M

    def frame(msg):
        line, _, raw = M.encode(msg).partition(b"\n")
        hdr = json.loads(line)
        assert hdr.pop("nbytes") == len(raw)
        return hdr, raw
    for msg in (M.Predict([2, 3], "float32", id=4, raw=b"\0" * 24), M.Generate([{"prompt": [1]}]),
                M.Join(7, {"prompt": [1, 2]}, stream=True), M.Cancel(7)):
        assert M.parse_request(*frame(msg)) == msg
    for msg in (M.Ready(pid=9, warmup_s=0.5, kv_cache=True, continuous=True), M.Outputs([1, 2], id=3),
                M.Outputs([[1], None], errors={"1": "PickError: x"}), M.Outputs([5], id=2, cancelled=True),
                M.Array([1, 4], id=1, raw=b"\0" * 16), M.Tokens(3, [4, 5], at=2), M.Held({"3": 4}),
                M.Error("boom", id=8)):
        assert M.parse_reply(*frame(msg)) == msg
    # the wire format the replica protocol documents (replica.py) and its raw-protocol test reads
    assert frame(M.Outputs([1], id=3)) == ({"outputs": [1], "id": 3}, b"")
    assert frame(M.Cancel(2)) == ({"op": "cancel", "id": 2}, b"")


async def _make(cls, opts):   # the pool's Condition and Events belong to a running loop
    return cls(opts, Metrics())


def test_a_new_request_goes_to_the_least_loaded_replica():
    """Two continuous replicas, the first holding 5 requests: of 8 queued, the idle second takes until it
    holds more than the first (6), then the first takes the rest (2). Counted, not timed."""
    from types import SimpleNamespace

    from tandem.serve import stream
    from tandem.serve.work import Replica, Work

    async def main():
        pool = Pool(PoolOptions(export=Path("unused"), replicas=2, max_batch=8, batch_wait_ms=0.0), Metrics())
        a, b = (Replica(i, SimpleNamespace(pid=100 + i, returncode=None), Path("log")) for i in (0, 1))
        a.continuous = b.continuous = True
        pool.live[:] = [a, b]
        loop = asyncio.get_running_loop()

        def work():
            return Work("generate", {"prompt": [1], "max_new_tokens": 4}, 1, loop.create_future())
        held_a = {k: work() for k in range(5)}
        a.load = 5                       # what its sender set when it took them
        pool.queue.extend(work() for _ in range(8))
        state = {"dead": False}
        got_b = await stream._take(pool, b, {}, state)
        assert (len(got_b), b.load, len(pool.queue)) == (6, 6, 2)
        got_a = await stream._take(pool, a, held_a, state)
        assert (len(got_a), a.load, len(pool.queue)) == (2, 7, 0)
        assert pool.least_loaded(b) and not pool.least_loaded(a)   # 6 < 7: the next one is the second's

    asyncio.run(main())
