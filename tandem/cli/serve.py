"""`tandem serve EXPORT_DIR [options]`: the flags checked and turned into PoolOptions, then the server
(serve/server.py) over the local engine (one front, N replica processes) or Ray Serve (serve/ray_engine.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Optional

import typer

from tandem.core.errors import ConfigError
from tandem.serve.server import check_tp, is_loopback, run_server


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
    body_timeout_s: float = typer.Option(30.0, "--body-timeout-s", help="Longest a request's body may take to "
                                         "arrive; beyond: 408."),
    max_connections: int = typer.Option(1024, "--max-connections", help="Open connections at once; beyond: 503 "
                                        "(each may hold --max-body of a body still arriving)."),
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
                                                       "Serve deployment on a Ray cluster (the `ray` extra); "
                                                       "vllm: vLLM OpenAI servers on a Hugging Face export "
                                                       "(`make vllm`)."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="--engine vllm: the python of a venv "
                                              "with vllm (default $TANDEM_VLLM_PYTHON, else .venv-vllm/bin/python)."),
    vllm_kv_cache_mib: int = typer.Option(64, "--vllm-kv-cache-mib", help="--engine vllm: KV cache per replica "
                                          "(vLLM's --kv-cache-memory-bytes)."),
    address: Optional[str] = typer.Option(None, "--address", help="--engine ray: a Ray head's HOST:PORT (else a "
                                                               "local Ray instance is started for this server)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model's id on the "
                                                    "OpenAI routes (/v1/models; a request's `model`); default "
                                                    "the export's model name."),
) -> None:
    """Serve an export over HTTP: /v1/predict, /v1/generate, OpenAI's /v1/completions, /v1/chat/completions
    and /v1/models, /livez, /readyz, /metrics.

    Example: tandem serve runs/gpt-reverse/export/step-00000116 --replicas 2
    """
    # the serving modules load when a server starts (fastapi/pydantic are the serving extra's)
    from tandem.serve.pool import PoolOptions
    from tandem.serve.schemas import ModelInfo

    make_pool, info = None, None
    if engine == "vllm" and address is None:   # a Hugging Face folder (`tandem export --format hf`)
        from tandem.serve.vllm_engine import vllm_pool_factory

        info, make_pool = vllm_pool_factory(export, vllm_python, replicas, tp, batching, vllm_kv_cache_mib)
    elif engine == "ray":
        from tandem.serve.ray_engine import ray_pool_factory

        if tp != 1:  # a Ray replica is one actor; spanning actors with one process group is not built
            raise ConfigError("tensor-parallel replicas are the local engine's", field="--tp", value=tp,
                              fix="serve with --engine local --tp N, or --engine ray without --tp")

        make_pool = ray_pool_factory(address, replicas, scale_up_p99_ms)
    elif engine != "local" or address is not None:
        raise ConfigError("is for --engine ray" if engine in ("local", "vllm") else "not an engine",
                          field="--address" if engine in ("local", "vllm") else "--engine",
                          value=address if engine in ("local", "vllm") else engine,
                          fix="give --engine local, --engine ray or --engine vllm")
    if not (export / "config.json").is_file():
        raise ConfigError("not an export folder (no config.json)", field="EXPORT_DIR", value=str(export),
                          fix="give a folder written by `tandem export`")
    from tandem.serve.autoscale import ScalePolicy, parse_replicas

    lo_rep, hi_rep = parse_replicas(replicas)
    for name, v, lo in (("--max-batch", max_batch, 1), ("--max-queue", max_queue, 1),
                        ("--max-body", max_body, 1024), ("--max-connections", max_connections, 2)):
        if v < lo:
            raise ConfigError(f"must be at least {lo}", field=name, value=v, fix=f"give {name} {lo} or more")
    if body_timeout_s < 0.1:
        raise ConfigError("must be at least 0.1", field="--body-timeout-s", value=body_timeout_s,
                          fix="give --body-timeout-s 0.1 or more")
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
    if info is None:
        check_tp(export, tp)
    if not 0 <= port <= 65535:
        raise ConfigError("not a TCP port", field="--port", value=port, fix="give 0..65535")
    keys = None
    if api_key_file is not None:
        from tandem.serve.auth import ApiKeys, loose_permissions

        keys = ApiKeys.from_file(api_key_file)
        if loose_permissions(api_key_file):
            print(f"warning: {api_key_file} may be read by other users; chmod 600 it", flush=True)
    info = info or ModelInfo.from_export(export)
    scale = ScalePolicy(lo_rep, hi_rep, up_queue=scale_up_queue or max_batch, up_s=scale_up_s,
                        down_s=scale_down_s, tick_s=min(0.25, scale_up_s / 4 or 0.05),
                        up_p99_ms=scale_up_p99_ms) if hi_rep > lo_rep else None
    opts = PoolOptions(export=export.resolve(), replicas=lo_rep, scale=scale, max_batch=max_batch,
                       batch_wait_ms=batch_wait_ms,
                       max_queue=max_queue, run_dir=run_dir.resolve(), hang_s=hang_s,
                       continuous=batching == "continuous", tp=tp,
                       # one core left to the front: torch's spinning threads on an oversubscribed CPU
                       # made a replica an order of magnitude slower (docs/bench.md, "Measurements behind
                       # the code's choices")
                       threads=threads or max(1, ((os.cpu_count() or 1) - 1) // (hi_rep * tp)))
    if not is_loopback(host) and keys is None:
        print(f"warning: binding {host} exposes the server beyond this machine and it has no authentication; "
              f"give --api-key-file, or put it behind a proxy that checks clients", flush=True)
    try:  # uvloop's event loop costs the front less per request than asyncio's
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(run_server(opts, info, host, port, drain_s, max_body, timeout_ms, keys, make_pool,
                   model_name=served_model_name, body_timeout_s=body_timeout_s, max_connections=max_connections))
