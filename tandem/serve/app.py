"""The HTTP front: FastAPI routes, bounded admission, metrics, and the SIGTERM drain.

Every /v1 request is parsed and validated here (schemas.py) before it is queued, so no bad input
reaches a replica. Codes: 400 malformed JSON, 401 without a valid API key (--api-key-file; /livez
and /readyz stay open), 413 body over the limit, 422 bad shape/dtype/value, 429 + Retry-After when
the queue is full, 504 when its timeout_ms passed before a replica took it, 503 + Retry-After while
draining (or no replica can take it), 404/405 from the router.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from tandem.core.extras import require

require("serve", "tandem serve")  # the whole serving stack, checked before any of it is imported: a
# missing extra is one line naming it, even where part of the stack is installed
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: E402

from tandem.serve import schemas
from tandem.serve.auth import OPEN_PATHS, ApiKeys, presented_key
from tandem.serve.metrics import Metrics
from tandem.serve.openai_api import PATHS as OPENAI_PATHS
from tandem.serve.openai_api import OpenAIRoutes
from tandem.serve.openai_api import error as openai_error
from tandem.serve.engine import Engine
from tandem.serve.work import DeadlineExceeded, QueueFull, ReplicaError, RequestFailed
from tandem.serve.tokenizer import TextCodec

ROUTES = {"/v1/predict", "/v1/generate", "/v1/info", "/livez", "/readyz", *OPENAI_PATHS}


@dataclass
class FrontState:
    draining: bool = False
    started: bool = False
    inflight: int = 0
    drain_over: bool = False   # --drain-s ran out: what is still held is answered 503
    # the deadlines of the bodies being read (asyncio.timeout): at the end of a drain they expire at once
    reading: set = field(default_factory=set)


ERRORS = {c: {"model": schemas.ErrorResponse, "description": d} for c, d in (
    (400, "not JSON, or not an object; or more than one Authorization / X-API-Key header"),
    (401, "missing or invalid API key (--api-key-file)"),
    (408, "the body did not arrive within --body-timeout-s"), (413, "body over --max-body"),
    (422, "a field is wrong (named in `field`)"), (429, "queue full: retry after Retry-After"),
    (500, "this request failed (named by its id), not retried"), (503, "draining, or no replica could answer"),
    (504, "timeout_ms passed before a replica took it"))}


def _body(model) -> dict:
    """The request body's schema for /docs: the routes read the body themselves (for 400/413 before
    validation), so FastAPI would not document it."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _err(code: int, msg: str, retry_after: int | None = None, field: str = "") -> tuple[int, dict, dict]:
    return code, {"error": msg, "field": field}, ({"retry-after": str(retry_after)} if retry_after is not None else {})


class Handlers:
    """The two inference routes as plain functions of the body: (status, JSON body, headers). The ASGI
    front (Front) calls them directly; the FastAPI routes (for /docs) call the same ones."""

    def __init__(self, pool: Engine, info: schemas.ModelInfo, default_timeout_ms: int):
        self.pool, self.info, self.default_timeout_ms = pool, info, default_timeout_ms

    async def _run(self, kind: str, payload, size: int, timeout_ms: int):
        try:
            return await self.pool.submit(kind, payload, size, timeout_ms), None
        except QueueFull:
            return None, _err(429, f"the queue is full ({self.pool.o.max_queue} waiting); retry later",
                              retry_after=1)
        except DeadlineExceeded as e:
            return None, _err(504, str(e))
        except RequestFailed as e:   # this request, not the server: no Retry-After
            return None, _err(500, str(e))
        except ReplicaError as e:
            return None, _err(503, f"no replica could answer: {e}", retry_after=1)

    async def predict(self, body: bytes) -> tuple[int, dict, dict]:
        try:
            obj = schemas.parse_json(body)
            xs, b64 = schemas.predict_inputs(obj, self.info, self.pool.o.max_batch)
            ms = schemas.timeout_ms(obj, self.default_timeout_ms)
        except schemas.BadRequest as e:
            return _err(e.code, str(e), field=e.field)
        out, bad = await self._run("predict", xs, len(xs), ms)
        if bad:
            return bad
        return 200, {"outputs": schemas.encode_array(out) if b64 else out.tolist(), "model": self.info.name}, {}

    async def generate(self, body: bytes) -> tuple[int, dict, dict]:
        try:
            obj = schemas.parse_json(body)
            req, text = schemas.generate_request(obj, self.info)
            ms = schemas.timeout_ms(obj, self.default_timeout_ms)
        except schemas.BadRequest as e:
            return _err(e.code, str(e), field=e.field)
        out, bad = await self._run("generate", req, 1, ms)
        if bad:
            return bad
        reply = {"tokens": out, "prompt": req["prompt"], "model": self.info.name}
        if text:
            reply["text"] = schemas.decode_text(out)
        return 200, reply, {}


class Front:
    """The ASGI app uvicorn runs: API keys, the drain's 503, request metrics, the body limit, and the two
    inference routes answered here directly; everything else goes to FastAPI. A plain ASGI layer, not
    FastAPI's http middleware (an anyio task group and memory streams per request): per-request cost
    in the front is what caps batching's throughput on a small machine."""

    def __init__(self, app: FastAPI, handlers: Handlers, metrics: Metrics, state: FrontState, max_body: int,
                 keys: ApiKeys | None, oai: OpenAIRoutes | None = None, body_timeout_s: float = 30.0):
        self.app, self.h, self.m, self.state, self.max_body, self.keys = app, handlers, metrics, state, max_body, keys
        self.body_timeout_s = body_timeout_s
        self.oai = oai   # /v1/completions, /v1/chat/completions, /v1/models: their errors in OpenAI's body
        self.hot = {"/v1/predict": handlers.predict, "/v1/generate": handlers.generate}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        creds = [k for k, v in scope["headers"] if k in (b"authorization", b"x-api-key") and v.strip()]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"authorization", b"x-api-key", b"content-length")}
        twice = self.keys is not None and len(creds) > 1 and path not in OPEN_PATHS
        authed = self.keys is None or path in OPEN_PATHS or (not twice and self.keys.check(presented_key(headers)))
        if path == "/metrics" and authed:
            return await self.app(scope, receive, send)
        route = path if path in ROUTES else "other"
        t0 = time.perf_counter()
        v1 = path.startswith("/v1/") and path != "/v1/info"
        status = [500]

        async def counted_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)
        oai = self.oai is not None and self.oai.handles(path)
        try:
            if twice:   # which one counts would be the server's guess (the last one, before): one, or 400
                msg = (f"{len(creds)} credential headers (Authorization / X-API-Key); send exactly one "
                       f"`Authorization: Bearer KEY`")
                await _send(send, status, *(openai_error(400, msg, "authorization", "duplicate_credentials") if oai
                                            else (400, {"error": msg, "field": "authorization"}, {})))
            elif not authed:  # the same answer for a missing header, another scheme and a wrong key
                msg = "missing or invalid API key (send Authorization: Bearer KEY)"
                await _send(send, status, *(openai_error(401, msg, "authorization", "invalid_api_key") if oai else
                                            (401, {"error": msg, "field": "authorization"}, {}))[:2],
                            {"www-authenticate": "Bearer"})
            elif v1 and self.state.draining:
                msg = "the server is draining (SIGTERM); retry on another instance"
                await _send(send, status, *(openai_error(503, msg, None, "draining", {"retry-after": "1"}) if oai
                                            else _err(503, msg, retry_after=1)))
            else:
                self.state.inflight += v1
                self.m.inflight.set(self.state.inflight)
                try:
                    handler = self.hot.get(path) if scope["method"] == "POST" else None
                    if oai:
                        try:
                            body = await self._body(receive, headers) if scope["method"] == "POST" else b""
                        except _Gone:
                            status[0] = 499
                            return
                        gone = await self.oai.handle(path, scope["method"], body, receive, counted_send)
                        status[0] = gone or status[0]
                    elif handler is None:
                        await self.app(scope, receive, counted_send)
                    else:
                        try:
                            body = await self._body(receive, headers)
                        except _Gone:
                            status[0] = 499   # nginx's "client closed request": not a server error
                            return
                        await _send(send, status, *(await handler(body) if isinstance(body, bytes) else body))
                finally:
                    self.state.inflight -= v1
                    self.m.inflight.set(self.state.inflight)
        finally:
            self.m.requests.labels(route, str(status[0])).inc()
            self.m.latency.labels(route).observe(time.perf_counter() - t0)


    async def _body(self, receive, headers: dict):
        """The body, or an answer instead: 413 over --max-body, 408 when it has not all arrived within
        --body-timeout-s (a slow upload holds a connection and up to --max-body of memory), 503 when
        the drain ends while it is still arriving. asyncio.timeout, not wait_for: a timer, not a task,
        on the hot path."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + self.body_timeout_s) as t:
                self.state.reading.add(t)
                try:
                    return await _read_body(receive, headers.get("content-length"), self.max_body)
                finally:
                    self.state.reading.discard(t)
        except TimeoutError:
            if self.state.drain_over:
                return _err(503, "the server stopped (its --drain-s ran out) before the body arrived", retry_after=1)
            return _err(408, f"the body did not arrive within {self.body_timeout_s:g} s (--body-timeout-s)")


class _Gone(Exception):
    """The client disconnected before its body arrived."""


async def _read_body(receive, declared: str | None, max_body: int):
    """The body's bytes, or a (413, ...) answer when it is over the limit (declared or streamed)."""
    if declared and declared.isdigit() and int(declared) > max_body:
        return _err(413, f"body of {declared} bytes is over the limit of {max_body}")
    chunks, n = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _Gone()
        c = msg.get("body", b"")
        n += len(c)
        if n > max_body:
            return _err(413, f"body is over the limit of {max_body} bytes")
        chunks.append(c)
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _send(send, status: list, code: int, body: dict, headers: dict) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    status[0] = code
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hs += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": code, "headers": hs})
    await send({"type": "http.response.body", "body": raw})


def build_app(pool: Engine, info: schemas.ModelInfo, metrics: Metrics, state: FrontState, *,
              max_body: int, default_timeout_ms: int = 0, keys: ApiKeys | None = None,
              export: str | None = None, model_name: str | None = None, body_timeout_s: float = 30.0) -> Front:
    app = FastAPI(title="tandem serve", summary=f"{info.name} ({info.kind}) from a tandem export")
    h = Handlers(pool, info, default_timeout_ms)
    oai = OpenAIRoutes(pool, info, TextCodec(export, info.vocab), metrics.llm, default_timeout_ms, model_name) \
        if export is not None else None

    def _reply(res: tuple[int, dict, dict]) -> JSONResponse:
        return JSONResponse(res[1], status_code=res[0], headers=res[2] or None)

    # Front answers these two itself; the routes are here for /docs (and call the same handlers)
    @app.post("/v1/predict", response_model=schemas.PredictResponse, responses=ERRORS,
              openapi_extra=_body(schemas.PredictRequest))
    async def predict(request: Request):
        """Outputs of the model on a list of examples (nested lists of the export's input shape, or base64)."""
        return _reply(await h.predict(await request.body()))

    @app.post("/v1/generate", response_model=schemas.GenerateResponse, responses=ERRORS,
              openapi_extra=_body(schemas.GenerateRequest))
    async def generate(request: Request):
        """Tokens continuing a prompt (token ids, or text for a byte-level vocabulary): greedy (temperature 0)
        or sampled (temperature, top_k, seed)."""
        return _reply(await h.generate(await request.body()))

    @app.get("/v1/info")
    async def model_info():
        """The model this server answers for and its limits (no filesystem path: the run dir and the
        export's folder are the operator's, in RUN_DIR/server.json)."""
        return {"model": info.public(), "replicas": pool.active, "max_batch": pool.o.max_batch,
                "max_queue": pool.o.max_queue}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """The router's own 404 and 405 in the documented body, not FastAPI's {"detail"}."""
        what = {404: f"no route {request.url.path} (routes: {', '.join(sorted(ROUTES))}, /metrics, /docs)",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse({"error": f"route: {what}", "field": "route"}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

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

    return Front(app, h, metrics, state, max_body, keys, oai, body_timeout_s)


async def drain(state: FrontState, timeout_s: float) -> None:
    """Wait until every admitted request is answered, or ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while state.inflight and time.monotonic() < end:
        await asyncio.sleep(0.01)


async def end_drain(state: FrontState, pool: Engine, drain_s: float, grace_s: float = 5.0) -> int:
    """--drain-s ran out: every request still held is answered 503 (its body still arriving, queued, or on
    a replica), then at most ``grace_s`` for those answers to be written. The requests it ended."""
    held = state.inflight
    if not held:
        return 0
    state.drain_over = True
    loop = asyncio.get_running_loop()
    for t in list(state.reading):
        t.reschedule(loop.time())
    pool.abort(f"the server is stopping: --drain-s {drain_s:g} s ran out before a replica answered")
    await drain(state, grace_s)
    return held
