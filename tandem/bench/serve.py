"""`tandem bench serve URL --rate R --duration S`: open-loop, constant-rate load on a tandem server.

Request i is due at i / R seconds; it is sent then whether or not earlier ones have been answered
(open loop), and its latency runs from that due time, not from when a busy client got round to
sending it, so a stalled server shows in the tail instead of hiding it (coordinated omission).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path


def body_for(info: dict, max_new_tokens: int, seed: int) -> tuple[str, bytes]:
    """The route and one fixed request body for the served model (from /v1/info)."""
    m = info["model"]
    rng = random.Random(seed)
    if m["kind"] == "gpt":
        half = max(1, m["seq"] // 2)
        prompt = [rng.randrange(m["vocab"]) for _ in range(half)]
        n = min(max_new_tokens, m["seq"] - half)
        return "/v1/generate", json.dumps({"prompt": prompt, "max_new_tokens": n}).encode()

    def example(shape):
        return [example(shape[1:]) for _ in range(shape[0])] if shape else round(rng.gauss(0, 1), 6)
    return "/v1/predict", json.dumps({"inputs": [example(m["example_shape"])]}).encode()


def percentile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return float("nan")
    k = max(0, min(len(sorted_xs) - 1, int(round(q / 100 * len(sorted_xs) + 0.5)) - 1))
    return sorted_xs[k]


class _Client:
    """A minimal HTTP/1.1 client on asyncio streams, keep-alive connections reused as they come free.
    The load generator must cost the server's CPU as little as possible on a shared machine: httpx's
    pool spent more CPU per request than the server did (its idle-connection scan grows with the
    number of connections, and an open loop at a high rate holds hundreds)."""

    def __init__(self, host: str, port: int, headers: dict[str, str]):
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.retry_after: dict[str, int] = {}   # responses that carried a Retry-After header, by code

    async def post(self, path: str, body: bytes, timeout_s: float) -> str:
        """The status code as a string, or the exception's name."""
        conn = self.idle.pop() if self.idle else None
        try:
            if conn is None:
                conn = await asyncio.open_connection(self.host, self.port)
            r, w = conn
            w.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n{self.extra}\r\n".encode() + body)
            code, keep, retry = await asyncio.wait_for(self._reply(r), timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            if conn is not None:
                conn[1].close()
            return type(e).__name__
        if retry:
            self.retry_after[code] = self.retry_after.get(code, 0) + 1
        if keep:
            self.idle.append(conn)
        else:
            w.close()
        return code

    @staticmethod
    async def _reply(r: asyncio.StreamReader) -> tuple[str, bool, bool]:
        status = await r.readline()
        if not status:
            raise ConnectionResetError("closed before answering")
        code, length, keep, chunked, retry = status.split()[1].decode(), 0, True, False, False
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "connection" and v.strip().lower() == "close":
                keep = False
            elif k == "transfer-encoding" and "chunked" in v.lower():   # Ray Serve's proxy answers so
                chunked = True
            elif k == "retry-after":
                retry = True
        if not chunked:
            await r.readexactly(length)
            return code, keep, retry
        while (size := int((await r.readline()).split(b";")[0], 16)) > 0:
            await r.readexactly(size + 2)   # the chunk and its CRLF
        while (await r.readline()) not in (b"\r\n", b""):   # trailers, then the blank line
            pass
        return code, keep, retry

    def close(self) -> None:
        for _, w in self.idle:
            w.close()


async def run_load(url: str, rate: float, duration: float, kill_at: float | None = None,
                   max_new_tokens: int = 8, seed: int = 0, timeout_s: float = 60.0, api_key: str | None = None,
                   mixed: bool = False, info: dict | None = None, run_dir: Path | str = "runs/serve") -> dict:
    """``mixed`` (gpt): every 4th request generates ``max_new_tokens``, the others 2 tokens: short
    requests arriving while long ones decode, where continuous batching differs from static.
    ``info``: the server's /v1/info, given for a server that has none (bench/serve_vs_ray.py's plain Ray
    Serve app gets the same requests as tandem's server of the same export). ``run_dir``: the server's
    (its replicas.json names the pid ``kill_at`` kills; /v1/info shows no filesystem path)."""
    import httpx

    url = url.rstrip("/")
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    parts = httpx.URL(url)
    async with httpx.AsyncClient(timeout=timeout_s, headers=auth) as client:
        info = info or (await client.get(f"{url}/v1/info")).json()
        route, body = body_for(info, max_new_tokens, seed)
        bodies = [body]
        if mixed and route == "/v1/generate":
            bodies += [body_for(info, 2, seed + k)[1] for k in (1, 2, 3)]
        n = max(1, int(rate * duration))
        loop = asyncio.get_running_loop()
        fast = _Client(parts.host, parts.port or 80, auth)
        t0 = loop.time() + 0.05
        results: list[tuple[float, float, str]] = []   # (due, latency, code)

        async def one(i: int) -> None:
            due = t0 + i / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            code = await fast.post(route, bodies[i % len(bodies)], timeout_s)
            results.append((due - t0, loop.time() - due, code))

        kill = asyncio.create_task(_kill_replica(client, url, Path(run_dir), t0 + kill_at, loop, t0)) \
            if kill_at is not None else None
        await asyncio.gather(*(one(i) for i in range(n)))
        span = loop.time() - t0
        fast.close()
        killed = await kill if kill else None
    ok = sorted(lat for _, lat, c in results if c == "200")
    by_due = sorted(results)
    quarter = max(1, len(by_due) // 4)
    first, last = (sorted(lat for _, lat, _ in part) for part in (by_due[:quarter], by_due[-quarter:]))
    codes: dict[str, int] = {}
    for _, _, c in results:
        codes[c] = codes.get(c, 0) + 1
    return {"url": url, "route": route, "rate": rate, "duration_s": duration, "sent": len(results),
            "ok": len(ok), "failed": len(results) - len(ok), "codes": dict(sorted(codes.items())),
            "retry_after": dict(sorted(fast.retry_after.items())),
            "throughput_rps": len(ok) / span if span > 0 else 0.0,
            "latency_ms": {k: 1000 * percentile(ok, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))}
            | {"max": 1000 * ok[-1] if ok else float("nan")}, "kill": killed,
            # a growing queue shows as latency rising through the run (first vs last quarter by due time)
            "p50_first_quarter_ms": 1000 * percentile(first, 50), "p50_last_quarter_ms": 1000 * percentile(last, 50),
            # every request: (intended send time from the start in s, latency in s, code), for --plot
            "samples": [[round(d, 6), round(lat, 6), c] for d, lat, c in by_due]}


async def _kill_replica(client, url: str, run_dir: Path, when: float, loop, t0: float = 0.0) -> dict:
    """SIGKILL replica 0 (its pid from the server's run dir) at ``when``; time until all are ready again."""
    await asyncio.sleep(max(0.0, when - loop.time()))
    doc = json.loads((run_dir / "replicas.json").read_text())
    pid = next(r["pid"] for r in doc["replicas"] if r["pid"])
    os.kill(pid, signal.SIGKILL)
    t_kill = loop.time()
    at = t_kill - t0
    deadline = t_kill + 60
    while loop.time() < deadline:  # poll /readyz until every replica serves again
        await asyncio.sleep(0.1)
        try:
            r = (await client.get(f"{url}/readyz")).json()
        except Exception:
            continue
        # back: every slot has a ready replica and none is the killed one (the file is rewritten on each
        # death and each start, so a dead slot shows pid null until its new replica has warmed up)
        reps = json.loads((run_dir / "replicas.json").read_text())["replicas"]
        if r.get("ready_replicas") == r.get("replicas") and all(x["ready"] and x["pid"] for x in reps) \
                and pid not in [x["pid"] for x in reps]:
            return {"pid": pid, "back_after_s": loop.time() - t_kill, "at_s": at}
    return {"pid": pid, "back_after_s": None, "at_s": at}


def print_report(res: dict, say=print) -> None:
    lat = res["latency_ms"]
    say(f"{res['route']} at {res['rate']:g} req/s for {res['duration_s']:g} s (open loop): {res['sent']} sent, "
        f"{res['ok']} ok, {res['failed']} failed")
    say(f"  throughput {res['throughput_rps']:.1f} req/s")
    say(f"  latency from intended send: p50 {lat['p50']:.1f} ms  p90 {lat['p90']:.1f} ms  p99 {lat['p99']:.1f} ms  "
        f"max {lat['max']:.1f} ms")
    say("  codes: " + ", ".join(f"{c}: {n}" for c, n in res["codes"].items()))
    k = res.get("kill")
    if k:
        back = f"back after {k['back_after_s']:.1f} s" if k["back_after_s"] is not None else "NOT back within 60 s"
        say(f"  killed replica pid {k['pid']} (SIGKILL); {back}")


def bench_serve(url: str, rate: float, duration: float, kill_at: float | None, max_new_tokens: int,
                api_key: str | None = None, run_dir: Path | str = "runs/serve") -> dict:
    t = time.perf_counter()
    res = asyncio.run(run_load(url, rate, duration, kill_at, max_new_tokens, api_key=api_key, run_dir=run_dir))
    res["wall_s"] = time.perf_counter() - t
    return res


# ---- the OpenAI routes: time to first token, inter-token latency, output tokens/s ----

class _SSEClient(_Client):
    async def post_events(self, path: str, body: bytes, timeout_s: float, loop) -> tuple[str, list, bytes]:
        """(status code or the exception's name, [(arrival time, one `data:` payload)], the whole body
        when it was not a stream). Chunks are timed as they arrive: the stream's token timing."""
        conn = self.idle.pop() if self.idle else None
        try:
            if conn is None:
                conn = await asyncio.open_connection(self.host, self.port)
            r, w = conn
            w.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n{self.extra}\r\n".encode() + body)
            code, keep, events, whole = await asyncio.wait_for(self._events(r, loop), timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            if conn is not None:
                conn[1].close()
            return type(e).__name__, [], b""
        if keep:
            self.idle.append(conn)
        else:
            w.close()
        return code, events, whole

    @staticmethod
    async def _events(r: asyncio.StreamReader, loop):
        status = await r.readline()
        if not status:
            raise ConnectionResetError("closed before answering")
        code, length, keep, chunked = status.split()[1].decode(), 0, True, False
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "connection" and v.strip().lower() == "close":
                keep = False
            elif k == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
        if not chunked:
            return code, keep, [], await r.readexactly(length)
        events, buf = [], b""
        while (size := int((await r.readline()).split(b";")[0], 16)) > 0:
            buf += (await r.readexactly(size + 2))[:-2]
            t = loop.time()
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if ev.startswith(b"data: "):
                    events.append((t, ev[6:]))
        while (await r.readline()) not in (b"\r\n", b""):
            pass
        return code, keep, events, b""


async def run_openai_load(url: str, rate: float, duration: float, stream: bool, max_tokens: int = 16,
                          seed: int = 0, timeout_s: float = 60.0, api_key: str | None = None,
                          prompt: str | None = None) -> dict:
    """Open loop on /v1/completions (token-id prompts of half the context, greedy, ``max_tokens`` each,
    eos ignored): per request its TTFT (due time -> first text chunk; the whole answer when not
    streamed), the gaps between its text chunks (ITL; a chunk is one token, or the few that reached the
    front together), and its usage (output tokens)."""
    import httpx

    url = url.rstrip("/")
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    parts = httpx.URL(url)
    async with httpx.AsyncClient(timeout=timeout_s, headers=auth) as client:
        info = (await client.get(f"{url}/v1/info")).json()["model"]
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
    rng = random.Random(seed)
    half = max(1, info["seq"] // 2)
    n_tok = min(max_tokens, info["seq"] + 1 - half)
    # random ids, or a text (an untrained model's reply to random ids may be bytes that are no UTF-8:
    # the server holds such text back to the end, so it comes as one chunk and shows no ITL)
    body = json.dumps({"model": model, "prompt": prompt or [rng.randrange(info["vocab"]) for _ in range(half)],
                       "max_tokens": n_tok, "temperature": 0, "ignore_eos": True, "stream": stream}
                      | ({"stream_options": {"include_usage": True}} if stream else {})).encode()
    n = max(1, int(rate * duration))
    loop = asyncio.get_running_loop()
    fast = _SSEClient(parts.host, parts.port or 80, auth)
    t0 = loop.time() + 0.05
    rows: list[dict] = []

    async def one(i: int) -> None:
        due = t0 + i / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
        code, events, whole = await fast.post_events("/v1/completions", body, timeout_s, loop)
        row = {"code": code, "latency": loop.time() - due, "ttft": None, "gaps": [], "tokens": 0}
        if code == "200":
            if stream:
                texts = [t for t, d in events if d != b"[DONE]" and json.loads(d).get("choices")]
                usage = [json.loads(d)["usage"] for _, d in events if d != b"[DONE]" and json.loads(d).get("usage")]
                row["ttft"] = texts[0] - due if texts else None
                row["gaps"] = [b - a for a, b in zip(texts, texts[1:])]
                row["tokens"] = usage[-1]["completion_tokens"] if usage else len(texts)
                row["prompt_tokens"] = usage[-1]["prompt_tokens"] if usage else half
                if not events or events[-1][1] != b"[DONE]":
                    row["code"] = "truncated"
            else:
                row["ttft"] = row["latency"]
                usage = json.loads(whole)["usage"]
                row["tokens"], row["prompt_tokens"] = usage["completion_tokens"], usage["prompt_tokens"]
        rows.append(row)

    await asyncio.gather(*(one(i) for i in range(n)))
    span = loop.time() - t0
    fast.close()
    ok = [r for r in rows if r["code"] == "200"]
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    itl = sorted(g for r in ok for g in r["gaps"])
    lat = sorted(r["latency"] for r in ok)
    codes: dict[str, int] = {}
    for r in rows:
        codes[r["code"]] = codes.get(r["code"], 0) + 1
    ms = lambda xs, q: 1000 * percentile(xs, q)  # noqa: E731
    return {"url": url, "route": "/v1/completions", "stream": stream, "rate": rate, "duration_s": duration,
            "max_tokens": n_tok, "prompt_tokens": ok[0]["prompt_tokens"] if ok else half,
            "sent": len(rows), "ok": len(ok),
            "failed": len(rows) - len(ok), "codes": dict(sorted(codes.items())),
            "throughput_rps": len(ok) / span if span > 0 else 0.0,
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / span if span > 0 else 0.0,
            "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
            "itl_ms": {"p50": ms(itl, 50), "p99": ms(itl, 99), "samples": len(itl)} if stream else None,
            "latency_ms": {"p50": ms(lat, 50), "p99": ms(lat, 99)}}


def print_openai_report(res: dict, say=print) -> None:
    mode = "stream" if res["stream"] else "non-stream"
    say(f"{res['route']} ({mode}) at {res['rate']:g} req/s for {res['duration_s']:g} s (open loop), "
        f"{res['prompt_tokens']}-token prompts, {res['max_tokens']} new tokens: {res['sent']} sent, {res['ok']} ok, "
        f"{res['failed']} failed")
    say(f"  throughput {res['throughput_rps']:.1f} req/s, {res['output_tokens_per_s']:.0f} output tokens/s")
    t = res["ttft_ms"]
    what = "time to first token" if res["stream"] else "time to first token (= the whole answer)"
    say(f"  {what}: p50 {t['p50']:.1f} ms  p99 {t['p99']:.1f} ms")
    if res["itl_ms"]:
        say(f"  inter-token latency: p50 {res['itl_ms']['p50']:.2f} ms  p99 {res['itl_ms']['p99']:.2f} ms")
    lat = res["latency_ms"]
    say(f"  latency from intended send: p50 {lat['p50']:.1f} ms  p99 {lat['p99']:.1f} ms")
    say("  codes: " + ", ".join(f"{c}: {n}" for c, n in res["codes"].items()))


def bench_openai(url: str, rate: float, duration: float, max_tokens: int, api_key: str | None = None) -> dict:
    """A non-stream run, then a stream run, at the same rate."""
    return {"non_stream": asyncio.run(run_openai_load(url, rate, duration, False, max_tokens, api_key=api_key)),
            "stream": asyncio.run(run_openai_load(url, rate, duration, True, max_tokens, api_key=api_key))}
