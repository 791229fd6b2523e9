"""The OpenAI-compatible routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Text goes in and out through the export's own tokenizer (tokenizer.py). Each choice (a prompt times
``n``) is one generate request to the pool, submitted with a sink (``Choice``) that receives its
tokens as the replica decodes them (stream.py and replica.py's "stream" frames): stop strings and
stop token ids are checked here, in the front, and a choice that hits one is cancelled, so the
replica drops it at its next decode step; a client that goes away cancels all of its choices the
same way. ``stream: true`` answers server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``; a replica that dies after a stream has sent text ends it with an error event (a
retry would send the text again), while a choice that has sent nothing is retried on another
replica as every request is. On an engine that does not stream (static batching, Ray) the tokens
arrive together at the end and the same code answers.

Errors are OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 the body is not a
JSON object, an unknown field, a parameter this engine does not support, a text prompt for an export
without a tokenizer, a prompt or max_tokens past the model's context; 401 no valid API key; 404 another
model name; 413 the body is over --max-body; 422 a field of the wrong type or out of range (``param``
names it), a token id outside the vocabulary; 429 the queue is full (Retry-After); 503 draining, or no
replica could answer; 504 timeout_ms passed before a replica took it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, Optional, Union

from tandem.core.extras import require

require("serve", "tandem serve")  # checked before the serving stack is imported: a missing extra is one line
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr  # noqa: E402

from tandem.serve import schemas
from tandem.serve.engine import Engine
from tandem.serve.messages import GREEDY_BELOW
from tandem.serve.tokenizer import NoTokenizer, TextCodec
from tandem.serve.work import DeadlineExceeded, QueueFull, ReplicaError, RequestFailed

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
MAX_N = 16
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable", 504: "timeout"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, OpenAI's error body, headers)."""
    return status, {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param,
                              "code": code}}, headers or {}


# ---- request bodies (fields OpenAI's API documents; values this engine cannot honour are refused) ----
Temperature = Optional[StrictFloat]   # strict: a number (an int too), not a string


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")   # OpenAI answers an unknown argument with 400; so do we
    model: StrictStr
    max_tokens: Optional[StrictInt] = Field(None, ge=0)
    temperature: Temperature = Field(None, ge=0, le=100, allow_inf_nan=False, description="default 1; 0: greedy")
    top_p: Temperature = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[StrictInt] = Field(None, ge=-1, description="vLLM's: -1 or 0: every token")
    seed: Optional[StrictInt] = Field(None, ge=0, le=2**62)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Optional[list[StrictInt]] = Field(None, description="vLLM's: stop at any of these ids")
    ignore_eos: StrictBool = Field(False, description="vLLM's: do not stop at the tokenizer's eos_token")
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Temperature = 0
    frequency_penalty: Temperature = 0
    logit_bias: Optional[dict] = None
    user: Optional[StrictStr] = None   # the caller's end-user id: accepted, not used
    return_token_ids: StrictBool = Field(False, description="each choice also carries its token_ids")
    timeout_ms: Optional[StrictInt] = Field(None, ge=0, le=3_600_000, description="tandem's deadline; 0: none")


class CompletionRequest(_Common):
    prompt: Any = Field(description="a string, a list of strings, token ids, or a list of token-id lists")
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None


class ChatRequest(_Common):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=0)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True


def _validate(model, obj: dict):
    try:
        return schemas.validate(model, obj)
    except schemas.BadRequest as e:
        unknown = str(e).split(": ", 1)[-1].startswith("unknown field")
        raise OpenAIError(400 if unknown else 422, str(e), e.field or None,
                          "unrecognized_argument" if unknown else "invalid_value") from None


def _unsupported(req, checks: list[tuple[str, bool]]) -> None:
    for name, bad in checks:
        if bad:
            raise OpenAIError(400, f"{name} is not supported by this engine (leave it out)", name, "unsupported")


class Choice:
    """One sequence: the sink its Work carries (on_started / on_tokens / on_lost), and its text so far.
    Text is emitted only up to where no stop string could still begin, and never ends inside a UTF-8
    character (the decoder's U+FFFD at the end waits for the next token)."""

    def __init__(self, index: int, prompt: list[int], req: dict, codec: TextCodec, stops: list[str],
                 stop_ids: set[int], llm, t0: float, stream: bool, notify):
        self.index, self.prompt, self.req, self.codec = index, prompt, req, codec
        self.stops, self.stop_ids, self.llm, self.t0, self.stream = stops, stop_ids, llm, t0, stream
        self.notify = notify
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.state = "waiting"
        self.llm.waiting += 1
        self.t_first = self.t_last = None
        self.engine_done, self.error, self.finish = False, None, None
        self._reset()

    def _reset(self) -> None:
        self.toks: list[int] = []    # received from the replica
        self.seen = 0                # of toks, examined for stops
        self.kept: list[int] = []    # the tokens the text is made of
        self.text, self.emitted, self.sent = "", 0, 0   # text; chars of it returned; tokens behind them

    def _move(self, to: str) -> None:
        if self.state == "waiting":
            self.llm.waiting -= 1
        elif self.state == "running":
            self.llm.running -= 1
        self.state = to
        if to == "waiting":
            self.llm.waiting += 1
        elif to == "running":
            self.llm.running += 1

    # ---- the sink (called by the continuous batcher) ----
    def on_started(self) -> None:
        if self.state == "waiting":
            self._move("running")

    def on_tokens(self, toks: list[int], at: int) -> None:
        if at > len(self.toks):
            return   # a gap cannot happen on one replica's ordered pipe; the final frame carries them all
        new = toks[len(self.toks) - at:]
        if not new:
            return
        now = time.monotonic()
        if self.t_first is None:
            self.t_first = now
            self.llm.ttft(now - self.t0)
        elif self.t_last is not None:
            self.llm.itl((now - self.t_last) / len(new), len(new))
        self.t_last = now
        self.toks.extend(new)
        self.notify(self)

    def on_lost(self) -> bool:
        """Its replica died: True if text already went to the client (then it fails); else it starts over."""
        if self.stream and self.emitted:
            return True
        self._reset()
        self._move("waiting")
        return False

    def on_done(self, task: asyncio.Task) -> None:
        if self.finish is not None:
            return   # ended here first (a stop): the cancelled task's outcome does not matter
        if task.cancelled():
            self.error = OpenAIError(499, "cancelled")
        elif task.exception() is not None:
            self.error = task.exception()
        else:
            out = list(task.result())
            if len(out) > len(self.toks):
                self.on_tokens(out[len(self.toks):], len(self.toks))
            self.engine_done = True
        self.notify(self)

    # ---- the text ----
    def advance(self) -> str:
        """Examine the tokens received since the last call: the text to return now (may be empty);
        ``finish`` is set when the sequence ended (stop, or length when the replica finished it)."""
        cut = None
        while self.seen < len(self.toks) and self.finish is None:
            t = self.toks[self.seen]
            self.seen += 1
            if t in self.stop_ids:
                self.finish = "stop"
                break
            self.kept.append(t)
            if self.stops:
                self.text = self.codec.decode(self.kept)
                lo = max(0, self.emitted - self.hold)
                hits = [i for i in (self.text.find(s, lo) for s in self.stops) if i >= 0]
                if hits:
                    cut, self.finish = min(hits), "stop"
        if not self.stops:
            self.text = self.codec.decode(self.kept)
        if cut is not None:
            self.text = self.text[:cut]
        if self.finish is None and self.engine_done and self.seen >= len(self.toks):
            self.finish = "length"
        end = len(self.text)
        if self.finish is None:
            end -= self.hold
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
        delta = self.text[self.emitted:max(end, self.emitted)]
        if delta:
            self.emitted += len(delta)
            self.sent = self.seen
        return delta

    @property
    def completion_tokens(self) -> int:
        return self.seen if self.finish == "stop" else len(self.toks)

    def close(self, reason: str) -> None:
        self._move("done")
        self.llm.finished(time.monotonic() - self.t0, len(self.prompt), len(self.toks), reason)


class OpenAIRoutes:
    """What the front (app.py) calls for PATHS: ``handle(path, method, body, receive, send)``."""

    def __init__(self, pool: Engine, info: schemas.ModelInfo, codec: TextCodec, llm, default_timeout_ms: int = 0,
                 model_name: str | None = None):
        self.pool, self.info, self.codec, self.llm = pool, info, codec, llm
        self.default_timeout_ms, self.model_name = default_timeout_ms, model_name or info.name
        self.created = int(time.time())
        slots = (lambda: pool.ready_count * pool.o.max_batch) if pool.streams else (lambda: 0)
        llm.bind(self.model_name, slots)

    @staticmethod
    def handles(path: str) -> bool:
        return path in PATHS

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "tandem", "max_model_len": self.info.seq}]}

    async def handle(self, path: str, method: str, body, receive, send) -> int | None:
        """Answers on ``send``; returns 499 when the client went away before an answer began."""
        try:
            if path == "/v1/models":
                if method != "GET":
                    raise OpenAIError(405, f"{method} is not allowed on {path} (GET it)")
                return await send_json(send, 200, self.models())
            if method != "POST":
                raise OpenAIError(405, f"{method} is not allowed on {path} (POST a JSON body)")
            if isinstance(body, tuple):   # the front's 413
                raise OpenAIError(body[0], body[1]["error"], None, "request_too_large")
            try:
                obj = schemas.parse_json(body)
            except schemas.BadRequest as e:
                raise OpenAIError(400, str(e), None, "invalid_json") from None
            chat = path == "/v1/chat/completions"
            req = _validate(ChatRequest if chat else CompletionRequest, obj)
            return await self._complete(req, chat, receive, send)
        except OpenAIError as e:
            await send_json(send, *error(e.status, e.message, e.param, e.code, e.headers))

    # ---- a request to its choices ----
    def _prompts(self, req, chat: bool) -> list[list[int]]:
        if req.model != self.model_name:
            raise OpenAIError(404, f"the model {req.model!r} does not exist (this server has {self.model_name!r})",
                              "model", "model_not_found")
        if self.info.kind != "gpt":
            raise OpenAIError(400, f"this export is a {self.info.name} classifier: use /v1/predict", "model")
        try:
            if chat:
                text = self.codec.render_chat(_messages(req.messages), req.add_generation_prompt)
                return [self.codec.encode(text, special=False)]
            p = req.prompt
            if isinstance(p, str):
                return [self.codec.encode(p)]
            if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
                return [self.codec.encode(x) for x in p]
            if isinstance(p, list) and p and all(type(x) is int for x in p):
                return [p]
            if isinstance(p, list) and p and all(isinstance(x, list) and all(type(t) is int for t in x) for x in p):
                return p
        except NoTokenizer as e:
            raise OpenAIError(400, str(e), "messages" if chat else "prompt", "no_tokenizer") from None
        except UnicodeEncodeError:
            raise OpenAIError(422, "is not valid Unicode (a lone surrogate?)", "messages" if chat else "prompt",
                              "invalid_value") from None
        except ImportError as e:
            raise OpenAIError(500, f"{e.name} is not installed: pip install 'tandem[serve]'", None,
                              "server_error") from None
        except Exception as e:   # the chat template raised (raise_exception, a bad role order): the caller's
            if not chat:
                raise
            raise OpenAIError(400, f"the chat template refused the messages: {e}", "messages") from None
        raise OpenAIError(422, "expected a string, a list of strings, a list of token ids or a list of token-id "
                               f"lists (got {schemas._short(p)})", "prompt", "invalid_value")

    def _choices(self, req, chat: bool, prompts: list[list[int]], notify) -> list[Choice]:
        info = self.info
        max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
        _unsupported(req, [("logprobs", bool(req.logprobs)), ("presence_penalty", bool(req.presence_penalty)),
                           ("frequency_penalty", bool(req.frequency_penalty)), ("logit_bias", bool(req.logit_bias))]
                     + ([("top_logprobs", req.top_logprobs is not None)] if chat else
                        [("echo", req.echo), ("best_of", req.best_of not in (None, 1)), ("suffix", bool(req.suffix))]))
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stops = [s for s in stops if s]
        if stops and not self.codec.text:
            raise OpenAIError(400, "stop strings need a tokenizer (this export has none): give stop_token_ids", "stop")
        stop_ids = set(req.stop_token_ids or [])
        if self.codec.eos_id is not None and not req.ignore_eos:
            stop_ids.add(self.codec.eos_id)
        for t in sorted(stop_ids):
            if not 0 <= t < info.vocab:
                raise OpenAIError(422, f"token {t} is out of the vocabulary 0..{info.vocab - 1}", "stop_token_ids")
        temp = 1.0 if req.temperature is None else float(req.temperature)
        temp = 0.0 if temp <= GREEDY_BELOW else temp
        top_k = 0 if req.top_k in (None, -1) or req.top_k >= info.vocab else req.top_k
        seed = secrets.randbits(62) if req.seed is None else req.seed
        field = "messages" if chat else "prompt"
        news = []
        for pi, prompt in enumerate(prompts):
            where = field if len(prompts) == 1 else f"{field}[{pi}]"
            if not prompt:
                raise OpenAIError(400, "the prompt has no tokens", where)
            if len(prompt) > info.seq:
                raise OpenAIError(400, f"the prompt has {len(prompt)} tokens; this model's context is {info.seq}",
                                  where, "context_length_exceeded")
            for t in prompt:
                if not 0 <= t < info.vocab:
                    raise OpenAIError(422, f"token {t} is out of the vocabulary 0..{info.vocab - 1}", where,
                                      "invalid_value")
            room = info.seq + 1 - len(prompt)   # learned positions: the last new token is never read back
            n = (room if chat else min(16, room)) if max_tokens is None else max_tokens
            if n > room:
                raise OpenAIError(400, f"max_tokens {n} and the prompt's {len(prompt)} tokens are past this "
                                       f"model's context of {info.seq} (at most {room})", "max_tokens",
                                  "context_length_exceeded")
            news.append(n)
        out, t0 = [], time.monotonic()
        for pi, (prompt, n) in enumerate(zip(prompts, news)):
            for j in range(req.n):
                r = {"prompt": prompt, "max_new_tokens": n, "temperature": temp, "top_k": top_k,
                     "seed": (seed + j) % 2**63}
                if req.top_p is not None and req.top_p < 1:
                    r["top_p"] = float(req.top_p)
                out.append(Choice(pi * req.n + j, prompt, r, self.codec, stops, stop_ids, self.llm, t0,
                                  req.stream, notify))
        return out

    # ---- running them ----
    async def _complete(self, req, chat: bool, receive, send) -> int | None:
        events: asyncio.Queue = asyncio.Queue()
        prompts = self._prompts(req, chat)
        choices = self._choices(req, chat, prompts, events.put_nowait)
        ms = self.default_timeout_ms if req.timeout_ms is None else req.timeout_ms
        tasks: dict[Choice, asyncio.Task] = {}
        for c in choices:
            coro = self.pool.submit("generate", c.req, 1, ms, sink=c if self.pool.streams else None)
            tasks[c] = t = asyncio.create_task(coro)
            t.add_done_callback(c.on_done)
        gone = asyncio.create_task(_disconnected(receive))   # the client going away wakes the loop below
        gone.add_done_callback(lambda t: t.cancelled() or events.put_nowait(None))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        out = _Out(send, rid, self.model_name, chat, req.stream)
        reason = "abort"
        try:
            await asyncio.sleep(0)   # every submit has run to its queue (or refused)
            for t in tasks.values():
                if t.done() and not t.cancelled() and isinstance(t.exception(), QueueFull):
                    raise OpenAIError(429, f"the queue is full ({self.pool.o.max_queue} waiting); retry later",
                                      None, "rate_limit_exceeded", {"retry-after": "1"})
            pending = set(choices)
            while pending:
                c = await events.get()
                if c is None:   # the client went away: its choices leave the replicas now (finally)
                    return None if out.started else 499
                if c not in pending:
                    continue
                if c.error is not None:
                    await out.fail(_as_openai(c.error))
                    return
                delta = c.advance()
                if c.finish is not None and not tasks[c].done():
                    tasks[c].cancel()   # a stop: the replica drops it before its next step
                if req.stream and (delta or c.finish):
                    await out.chunk(c.index, delta, c.finish)
                if c.finish is not None:
                    pending.discard(c)
            reason = "ok"
            usage = {"prompt_tokens": sum(len(p) for p in prompts),
                     "completion_tokens": sum(c.completion_tokens for c in choices)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            if req.stream:
                await out.end(usage if req.stream_options and req.stream_options.include_usage else None)
            else:
                await out.whole(choices, usage, req.return_token_ids)
        finally:
            gone.cancel()
            for c, t in tasks.items():
                if not t.done():
                    t.cancel()
                c.close(c.finish if reason == "ok" else "abort")


def _as_openai(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, QueueFull):   # an engine whose submit refuses after its first await (Ray)
        return OpenAIError(429, "the queue is full; retry later", None, "rate_limit_exceeded", {"retry-after": "1"})
    if isinstance(e, DeadlineExceeded):
        return OpenAIError(504, str(e), None, "timeout")
    if isinstance(e, RequestFailed):   # this request, not the server: no Retry-After
        return OpenAIError(500, str(e), None, "request_failed")
    if isinstance(e, ReplicaError):
        return OpenAIError(503, f"no replica could answer: {e}", None, "replica_error", {"retry-after": "1"})
    return OpenAIError(500, f"{type(e).__name__}: {e}", None, "server_error")


def _messages(msgs: list[dict]) -> list[dict]:
    """OpenAI's messages for the template: content as one string (a list of parts: their text joined)."""
    out = []
    for i, m in enumerate(msgs):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise OpenAIError(422, "each message needs a role (system, user, assistant, ...)", f"messages[{i}].role",
                              "invalid_value")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise OpenAIError(400, "only text parts are supported", f"messages[{i}].content", "unsupported")
            content = "".join(str(p.get("text", "")) for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise OpenAIError(422, f"expected a string or a list of text parts (got {type(content).__name__})",
                              f"messages[{i}].content", "invalid_value")
        out.append({**m, "role": role, "content": content})
    return out


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Out:
    """The answer: one JSON body, or server-sent events (headers sent with the first event, so a
    request that fails before any token still gets its HTTP status)."""

    def __init__(self, send, rid: str, model: str, chat: bool, stream: bool):
        self.send, self.rid, self.model, self.chat, self.stream = send, rid, model, chat, stream
        self.created, self.started, self.roles = int(time.time()), False, set()

    def _head(self, kind: str) -> dict:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    async def _event(self, obj) -> None:
        if not self.started:
            self.started = True
            await self.send({"type": "http.response.start", "status": 200,
                             "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                         (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        data = obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        await self.send({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})

    async def chunk(self, index: int, delta: str, finish: str | None) -> None:
        if self.chat:
            d = {"content": delta} if delta else {}
            if index not in self.roles:
                self.roles.add(index)
                d = {"role": "assistant", "content": delta}
            ch = {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}
            await self._event({**self._head("chat.completion.chunk"), "choices": [ch]})
        else:
            ch = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}
            await self._event({**self._head("text_completion"), "choices": [ch]})

    async def end(self, usage: dict | None) -> None:
        if usage is not None:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            await self._event({**self._head(kind), "choices": [], "usage": usage})
        await self._event(b"[DONE]")
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def fail(self, e: OpenAIError) -> None:
        if not self.stream or not self.started:
            return await send_json(self.send, *error(e.status, e.message, e.param, e.code, e.headers))
        # mid-stream: the status has gone; the error is an event the client sees (openai raises APIError)
        await self._event(error(e.status, e.message, e.param, e.code)[1])
        await self.end(None)

    async def whole(self, choices: list[Choice], usage: dict, token_ids: bool) -> None:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            ch = {"index": c.index, "logprobs": None, "finish_reason": c.finish}
            if self.chat:
                ch["message"] = {"role": "assistant", "content": c.text}
            else:
                ch["text"] = c.text
            if token_ids or not c.codec.text:   # an export without a tokenizer: the tokens are the answer
                ch["token_ids"] = c.kept   # up to the stop: a stop token id is not returned
            out.append(ch)
        await send_json(self.send, 200, {**self._head("chat.completion" if self.chat else "text_completion"),
                                         "choices": out, "usage": usage})


async def send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hs += [(k.encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": raw})
