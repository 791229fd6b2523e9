"""`tandem serve EXPORT_DIR [options]`: the local engine (one front, N replica processes)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
from pathlib import Path
from typing import Optional

import typer

from tandem.core.errors import ConfigError, WorkerFailure


def serve_cmd(
    export: Path = typer.Argument(..., help="An export folder written by `tandem export`."),
    replicas: str = typer.Option("1", "--replicas", help="Replica processes, each loading the export once: N, "
                                                        "or MIN:MAX to autoscale on queue depth (and p99: "
                                                        "--scale-up-p99-ms)."),
    max_batch: int = typer.Option(32, "--max-batch", help="Most examples (predict) or requests (generate) "
                                                          "per batch."),
    batch_wait_ms: float = typer.Option(5.0, "--batch-wait-ms", help="Longest a request waits for its batch "
                                                                     "to fill."),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests waiting at once; beyond: 429."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free port, written to RUN_DIR/server.json)."),
    drain_s: float = typer.Option(30.0, "--drain-s", help="On SIGTERM: longest wait for admitted requests."),
    run_dir: Path = typer.Option(Path("runs/serve"), "--run-dir", help="server.json, replicas.json (pids), "
                                                                      "replica logs."),
    threads: int = typer.Option(0, "--threads", help="torch threads per replica (0: (cores - 1) / replicas, "
                                                          "at least 1)."),
    max_body: int = typer.Option(8 << 20, "--max-body", help="Largest request body in bytes; beyond: 413."),
    hang_s: float = typer.Option(60.0, "--hang-s", help="A replica that answers no batch within this is "
                                                        "killed, restarted, and its batch retried."),
    timeout_ms: int = typer.Option(0, "--timeout-ms", help="Default deadline of a request (its timeout_ms field "
                                                           "overrides); expired ones are dropped before a "
                                                           "replica sees them (504). 0: none."),
    scale_up_queue: int = typer.Option(0, "--scale-up-queue", help="MIN:MAX: a queue deeper than this counts as "
                                                                "overloaded (0: --max-batch)."),
    scale_up_s: float = typer.Option(2.0, "--scale-up-s", help="MIN:MAX: add a replica when the queue stays "
                                                             "overloaded this long."),
    scale_down_s: float = typer.Option(30.0, "--scale-down-s", help="MIN:MAX: remove one when the queue stays "
                                                                 "empty and a replica idle this long."),
    scale_up_p99_ms: float = typer.Option(0.0, "--scale-up-p99-ms", help="MIN:MAX: also add a replica when the "
                                          "p99 of the last 5 s of answers stays above this for --scale-up-s "
                                          "(0: off, the queue alone)."),
    batching: str = typer.Option("continuous", "--batching", help="GPT exports: continuous (a request joins the "
                                 "running batch at the next decode step) or static (whole batches)."),
    tp: int = typer.Option(1, "--tp", help="Processes per replica, one torch.distributed group, each "
                                           "holding its tp-R-of-N shards (export with --tp N)."),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", help="Require one of these keys (one per "
                                                 "line) as `Authorization: Bearer KEY` on every route but "
                                                 "/livez and /readyz; else 401."),
    engine: str = typer.Option("local", "--engine", help="local: replica processes on this machine; ray: a Ray "
                                                       "Serve deployment on a Ray cluster (the `ray` extra)."),
    address: Optional[str] = typer.Option(None, "--address", help="--engine ray: a Ray head's HOST:PORT (else a "
                                                               "local Ray instance is started for this server)."),
) -> None:
    """Serve an export over HTTP: /v1/predict, /v1/generate, /livez, /readyz, /metrics.

    Example: tandem serve runs/gpt-reverse/export/step-00000116 --replicas 2
    """
    from tandem.serve.pool import PoolOptions
    from tandem.serve.schemas import ModelInfo

    make_pool = None
    if engine == "ray":
        from tandem.serve.cli_ray import ray_pool_factory

        if tp != 1:  # a Ray replica is one actor; spanning actors with one process group is not built
            raise ConfigError("tensor-parallel replicas are the local engine's", field="--tp", value=tp,
                              fix="serve with --engine local --tp N, or --engine ray without --tp")

        make_pool = ray_pool_factory(address, replicas, scale_up_p99_ms)
    elif engine != "local" or address is not None:
        raise ConfigError("is for --engine ray" if engine == "local" else "not an engine",
                          field="--address" if engine == "local" else "--engine",
                          value=address if engine == "local" else engine, fix="give --engine local or --engine ray")
    if not (export / "config.json").is_file():
        raise ConfigError("not an export folder (no config.json)", field="EXPORT_DIR", value=str(export),
                          fix="give a folder written by `tandem export`")
    from tandem.serve.autoscale import ScalePolicy, parse_replicas

    lo_rep, hi_rep = parse_replicas(replicas)
    for name, v, lo in (("--max-batch", max_batch, 1), ("--max-queue", max_queue, 1),
                        ("--max-body", max_body, 1024)):
        if v < lo:
            raise ConfigError(f"must be at least {lo}", field=name, value=v, fix=f"give {name} {lo} or more")
    if hang_s < 0.1:
        raise ConfigError("must be at least 0.1", field="--hang-s", value=hang_s, fix="give --hang-s 0.1 or more")
    for name, v in (("--scale-up-queue", scale_up_queue), ("--scale-up-s", scale_up_s),
                    ("--scale-down-s", scale_down_s), ("--batch-wait-ms", batch_wait_ms), ("--drain-s", drain_s),
                    ("--threads", threads), ("--scale-up-p99-ms", scale_up_p99_ms),
                    ("--timeout-ms", timeout_ms)):
        if v < 0:
            raise ConfigError("must not be negative", field=name, value=v, fix=f"give {name} 0 or more")
    if batching not in ("continuous", "static"):
        raise ConfigError("must be continuous or static", field="--batching", value=batching,
                          fix="give --batching continuous or --batching static")
    _check_tp(export, tp)
    if not 0 <= port <= 65535:
        raise ConfigError("not a TCP port", field="--port", value=port, fix="give 0..65535")
    keys = None
    if api_key_file is not None:
        from tandem.serve.auth import ApiKeys, loose_permissions

        keys = ApiKeys.from_file(api_key_file)
        if loose_permissions(api_key_file):
            print(f"warning: {api_key_file} may be read by other users; chmod 600 it", flush=True)
    info = ModelInfo.from_export(export)
    scale = ScalePolicy(lo_rep, hi_rep, up_queue=scale_up_queue or max_batch, up_s=scale_up_s,
                        down_s=scale_down_s, tick_s=min(0.25, scale_up_s / 4 or 0.05),
                        up_p99_ms=scale_up_p99_ms) if hi_rep > lo_rep else None
    opts = PoolOptions(export=export.resolve(), replicas=lo_rep, scale=scale, max_batch=max_batch,
                       batch_wait_ms=batch_wait_ms,
                       max_queue=max_queue, run_dir=run_dir.resolve(), hang_s=hang_s,
                       continuous=batching == "continuous", tp=tp,
                       # one core left to the front: torch's spinning threads on an oversubscribed CPU
                       # made a replica ~10x slower here (2 cores: p99 6.8 s against 0.2 s at 60 req/s)
                       threads=threads or max(1, ((os.cpu_count() or 1) - 1) // (hi_rep * tp)))
    if not _loopback(host) and keys is None:
        print(f"warning: binding {host} exposes the server beyond this machine and it has no authentication; "
              f"give --api-key-file, or put it behind a proxy that checks clients", flush=True)
    try:  # uvloop's event loop costs the front less per request than asyncio's
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(_serve(opts, info, host, port, drain_s, max_body, timeout_ms, keys, make_pool))


def _check_tp(export: Path, tp: int) -> None:
    if tp == 1:
        return
    have = json.loads((export / "config.json").read_text()).get("tp", 1)
    if tp < 1 or have != tp:
        raise ConfigError(f"the export holds tp-R-of-{have} shards" if have > 1 else
                          "the export has no tensor-parallel shards", field="--tp", value=tp,
                          fix=f"give --tp {have}" if have > 1 else
                          f"export again with `tandem export RUN --tp {tp}`, or serve without --tp")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
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


async def _serve(opts, info, host: str, port: int, drain_s: float, max_body: int, timeout_ms: int, keys,
                 make_pool=None) -> None:
    import uvicorn

    from tandem.serve.app import FrontState, build_app, drain
    from tandem.serve.metrics import Metrics
    from tandem.serve.pool import Pool, ReplicaError

    metrics, state = Metrics(), FrontState()
    pool = (make_pool or Pool)(opts, metrics, say=lambda m: print(m, flush=True))
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    app = build_app(pool, info, metrics, state, max_body=max_body, run_dir=str(opts.run_dir),
                    default_timeout_ms=timeout_ms, keys=keys)
    loop = asyncio.get_running_loop()

    async def on_term() -> None:
        print(f"serve: SIGTERM: draining {state.inflight} in-flight request(s), at most {drain_s:g} s", flush=True)
        await drain(state, drain_s)
        server.should_exit = True

    class Server(uvicorn.Server):
        """uvicorn stops accepting at once on SIGTERM; we first answer 503 and let admitted work finish."""

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not state.draining:
                state.draining = True
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(on_term()))
            else:
                super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                   lifespan="off"))
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
        pids = ", ".join(str(r.pid) for r in pool.live if r)
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
