"""The `tandem serve` process: the HTTP front bound and run over its pool of replicas, drained on SIGTERM.

uvicorn and the app load inside run_server: fastapi/uvicorn are the serving extra's, and importing this
module must not need them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
from pathlib import Path

from tandem.core.errors import ConfigError, WorkerFailure


def check_tp(export: Path, tp: int) -> None:
    """--tp N needs an export written with --tp N (its tp-R-of-N shards)."""
    if tp == 1:
        return
    have = json.loads((export / "config.json").read_text()).get("tp", 1)
    if tp < 1 or have != tp:
        raise ConfigError(f"the export holds tp-R-of-{have} shards" if have > 1 else
                          "the export has no tensor-parallel shards", field="--tp", value=tp,
                          fix=f"give --tp {have}" if have > 1 else
                          f"export again with `tandem export RUN --tp {tp}`, or serve without --tp")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise ConfigError(f"cannot bind ({e.strerror})", field="--port", value=f"{host}:{port}",
                          fix="choose a free port (or --port 0 for any)") from None
    s.listen(2048)
    s.set_inheritable(False)
    return s


async def run_server(opts, info, host: str, port: int, drain_s: float, max_body: int, timeout_ms: int, keys,
                     make_pool=None, model_name: str | None = None, body_timeout_s: float = 30.0,
                     max_connections: int = 1024) -> None:
    """The front (app.py) over a pool of replicas, on HOST:PORT until SIGTERM (drained) or Ctrl-C;
    RUN_DIR/server.json says where it listens."""
    import uvicorn

    from tandem.serve.app import FrontState, build_app, drain, end_drain
    from tandem.serve.metrics import Metrics
    from tandem.serve.pool import Pool, ReplicaError

    metrics, state = Metrics(), FrontState()
    pool = (make_pool or Pool)(opts, metrics, say=lambda m: print(m, flush=True))
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    app = build_app(pool, info, metrics, state, max_body=max_body,
                    default_timeout_ms=timeout_ms, keys=keys, export=str(opts.export),
                    model_name=model_name, body_timeout_s=body_timeout_s)
    loop = asyncio.get_running_loop()

    async def on_term() -> None:
        pool.drain()   # no replica restarted or added from now on: the server is going
        print(f"serve: SIGTERM: draining {state.inflight} in-flight request(s), at most {drain_s:g} s", flush=True)
        await drain(state, drain_s)
        ended = await end_drain(state, pool, drain_s)
        if ended:
            print(f"serve: --drain-s {drain_s:g} s ran out: {ended} request(s) still held answered 503", flush=True)
        server.should_exit = True

    class Server(uvicorn.Server):
        """uvicorn stops accepting at once on SIGTERM; we first answer 503 and let admitted work finish."""

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not state.draining:
                state.draining = True
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(on_term()))
            else:
                super().handle_exit(sig, frame)

    # limit_concurrency: uvicorn answers 503 to a request when this many connections are open, its own
    # included, so + 1 serves --max-connections at once (each may hold --max-body of a body still
    # arriving, for at most --body-timeout-s)
    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                   lifespan="off", limit_concurrency=max_connections + 1))
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    tmp = opts.run_dir / "server.json.tmp"   # whole or absent: a reader polls for it
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "export": str(opts.export)}) + "\n")
    os.replace(tmp, opts.run_dir / "server.json")
    served = asyncio.create_task(server.serve(sockets=[sock]))
    print(f"serve: {info.name} ({info.kind}) from {opts.export} on {url}; loading {opts.replicas} replica(s)",
          flush=True)
    try:
        try:
            await pool.start()
        except ReplicaError as e:
            server.should_exit = True
            await served
            raise WorkerFailure(str(e), field="replica", value=str(opts.export),
                                fix=f"see {opts.run_dir}/replica-*.log; check the export with "
                                    f"`tandem export verify`") from None
        state.started = True
        pids = ", ".join(map(str, pool.ready_pids()))
        auth = f"; {len(keys)} API key(s) required" if keys is not None else ""
        sc = opts.scale
        scaling = f" of {sc.min_replicas}:{sc.max_replicas}" if sc else ""
        tp = f" of {opts.tp} tp ranks" if opts.tp > 1 else ""
        print(f"ready: {url} ({opts.replicas}{scaling} replica(s){tp}, pids {pids}; max batch {opts.max_batch}, "
              f"queue {opts.max_queue}{auth}); Ctrl-C or SIGTERM to stop", flush=True)
        await served
    finally:
        await pool.close()
        print("serve: stopped", flush=True)
