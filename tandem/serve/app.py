"""The HTTP front: FastAPI routes, bounded admission, metrics, and the SIGTERM drain.

Every /v1 request is parsed and validated here (schemas.py) before it is queued, so no bad input
reaches a replica. Codes: 400 malformed JSON, 401 without a valid API key (--api-key-file; /livez
and /readyz stay open), 413 body over the limit, 422 bad shape/dtype/value, 429 + Retry-After when
the queue is full, 504 when its timeout_ms passed before a replica took it, 503 + Retry-After while
draining (or no replica can take it), 404/405 from the router.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.serve import schemas
from tandem.serve.auth import OPEN_PATHS, ApiKeys, presented_key
from tandem.serve.metrics import Metrics
from tandem.serve.pool import DeadlineExceeded, Pool, QueueFull, ReplicaError

ROUTES = {"/v1/predict", "/v1/generate", "/v1/info", "/livez", "/readyz"}


@dataclass
class FrontState:
    draining: bool = False
    started: bool = False
    inflight: int = 0


ERRORS = {c: {"model": schemas.ErrorResponse, "description": d} for c, d in (
    (400, "not JSON, or not an object"), (401, "missing or invalid API key (--api-key-file)"), (413, "body over --max-body"),
    (422, "a field is wrong (named in `field`)"), (429, "queue full: retry after Retry-After"),
    (503, "draining, or no replica could answer"), (504, "timeout_ms passed before a replica took it"))}


def _body(model) -> dict:
    """The request body's schema for /docs: the routes read the body themselves (for 400/413 before
    validation), so FastAPI would not document it."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _err(code: int, msg: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": msg}, status_code=code, headers=headers)


def build_app(pool: Pool, info: schemas.ModelInfo, metrics: Metrics, state: FrontState, *,
              max_body: int, run_dir: str, default_timeout_ms: int = 0, keys: ApiKeys | None = None) -> FastAPI:
    app = FastAPI(title="tandem serve", summary=f"{info.name} ({info.kind}) from a tandem export")

    @app.middleware("http")
    async def count(request: Request, call_next):
        path = request.url.path
        if path == "/metrics" and (keys is None or keys.check(presented_key(request.headers))):
            return await call_next(request)
        route = path if path in ROUTES else "other"
        t0 = time.perf_counter()
        v1 = path.startswith("/v1/") and path != "/v1/info"
        if keys is not None and path not in OPEN_PATHS and not keys.check(presented_key(request.headers)):
            # the same answer for a missing header, another scheme and a wrong key
            resp = JSONResponse({"error": "missing or invalid API key (send Authorization: Bearer KEY)",
                                 "field": "authorization"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        elif v1 and state.draining:
            resp = _err(503, "the server is draining (SIGTERM); retry on another instance", retry_after=1)
        else:
            state.inflight += v1
            metrics.inflight.set(state.inflight)
            try:
                resp = await call_next(request)
            finally:
                state.inflight -= v1
                metrics.inflight.set(state.inflight)
        metrics.requests.labels(route, str(resp.status_code)).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - t0)
        return resp

    async def body_of(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body:
            raise schemas.BadRequest(413, f"body of {declared} bytes is over the limit of {max_body}")
        chunks, n = [], 0
        async for c in request.stream():
            n += len(c)
            if n > max_body:
                raise schemas.BadRequest(413, f"body is over the limit of {max_body} bytes")
            chunks.append(c)
        return schemas.parse_json(b"".join(chunks))

    async def run(kind: str, payload, size: int, timeout_ms: int):
        try:
            return await pool.submit(kind, payload, size, timeout_ms), None
        except QueueFull:
            return None, _err(429, f"the queue is full ({pool.o.max_queue} waiting); retry later", retry_after=1)
        except DeadlineExceeded as e:
            return None, _err(504, str(e))
        except ReplicaError as e:
            return None, _err(503, f"no replica could answer: {e}", retry_after=1)

    def _bad(e: schemas.BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(e), "field": e.field}, status_code=e.code)

    @app.post("/v1/predict", response_model=schemas.PredictResponse, responses=ERRORS,
              openapi_extra=_body(schemas.PredictRequest))
    async def predict(request: Request):
        """Outputs of the model on a list of examples (nested lists of the export's input shape, or base64)."""
        try:
            obj = await body_of(request)
            xs, b64 = schemas.predict_inputs(obj, info, pool.o.max_batch)
            ms = schemas.timeout_ms(obj, default_timeout_ms)
        except schemas.BadRequest as e:
            return _bad(e)
        out, bad = await run("predict", xs, len(xs), ms)
        if bad:
            return bad
        return {"outputs": schemas.encode_array(out) if b64 else out.tolist(), "model": info.name}

    @app.post("/v1/generate", response_model=schemas.GenerateResponse, response_model_exclude_none=True,
              responses=ERRORS, openapi_extra=_body(schemas.GenerateRequest))
    async def generate(request: Request):
        """Tokens continuing a prompt (token ids, or text for a byte-level vocabulary): greedy (temperature 0)
        or sampled (temperature, top_k, seed)."""
        try:
            obj = await body_of(request)
            req, text = schemas.generate_request(obj, info)
            ms = schemas.timeout_ms(obj, default_timeout_ms)
        except schemas.BadRequest as e:
            return _bad(e)
        out, bad = await run("generate", req, 1, ms)
        if bad:
            return bad
        reply = {"tokens": out, "prompt": req["prompt"], "model": info.name}
        if text:
            reply["text"] = schemas.decode_text(out)
        return reply

    @app.get("/v1/info")
    async def model_info():
        """The model this server answers for, its limits, and the run dir (replicas.json holds the pids)."""
        return {"model": info.public(), "replicas": pool.active, "max_batch": pool.o.max_batch,
                "max_queue": pool.o.max_queue, "run_dir": run_dir}

    @app.get("/livez")
    async def livez():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        ready = pool.ready_count
        body = {"ready_replicas": ready, "replicas": pool.active, "draining": state.draining}
        if state.draining or not state.started or ready == 0:
            return JSONResponse({"status": "unavailable", **body}, status_code=503)
        return {"status": "ready", **body}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def drain(state: FrontState, timeout_s: float) -> None:
    """Wait until every admitted request is answered, or ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while state.inflight and time.monotonic() < end:
        await asyncio.sleep(0.01)
