"""tandem's front over vLLM (`tandem serve HF_DIR --engine vllm`) against bare vLLM's OpenAI server, on the
same Hugging Face export, at a fixed concurrency.

    python bench/serve_vs_vllm.py HF_DIR [--concurrency 8] [--requests 200] [--max-tokens 16] [--rounds 3]
                                          [--json FILE]

Both sides run one vLLM replica started the same way (the argv of tandem/serve/vllm_engine.py: eager, the same
KV-cache size, --max-num-seqs, --skip-tokenizer-init, dtype) from the same side venv (`make vllm`):
  bare    `python -m vllm.entrypoints.openai.api_server --model HF_DIR ...` on its own port
  tandem  `tandem serve HF_DIR --engine vllm --replicas 1` (the front: auth check, admission, metrics, the
          OpenAI routes' own tokenizer-side work, then the same request streamed to its vLLM replica)
Each side gets the same closed loop: ``--concurrency`` clients, each sending its next request as soon as
its last one is answered, streamed /v1/completions of token-id prompts (the reverse task's, digits then
the separator), greedy, ``--max-tokens`` each, eos ignored, ``stream_options.include_usage``. Rounds
alternate between the sides (bare, tandem, tandem, bare, ...) so that a busy neighbour on a shared
machine costs both alike; a warm-up of 2 x concurrency requests each first. Printed per side:
requests/s, output tokens/s (from the usage), TTFT p50/p99 (send -> the first event carrying a token),
the CPU seconds per request of each process group (/proc: bare vLLM's three processes; tandem's front,
and its replica's three), and the ratio tandem / bare (the issue's target: the front costs at most 5%
of bare vLLM's throughput). On a shared machine the throughput ratio moves with the neighbours; the
CPU per request does not, and says what the front costs where it has a core of its own.
A bare vLLM chunk carries token ids (return_token_ids); tandem's carries text, so give a byte-level
(vocab 256) export, or one with a tokenizer, for the front to stream text token by token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.bench.serve import _SSEClient, percentile  # noqa: E402


def start_bare(hf: Path, python: str, max_batch: int, log: Path) -> tuple[subprocess.Popen, str]:
    """Bare vLLM with the argv tandem's engine gives its replicas (less the API key)."""
    from tandem.serve.metrics import Metrics
    from tandem.serve.pool import PoolOptions
    from tandem.serve.vllm_engine import VllmOptions, VllmPool, _free_port, hf_model_info

    info, dtype = hf_model_info(hf)
    pool = VllmPool(PoolOptions(export=hf, max_batch=max_batch, threads=1, run_dir=log.parent),
                    Metrics(), VllmOptions(python=python, dtype=dtype, seq=info.seq), model_name="bare")
    port = _free_port()
    env = {**pool._env()}
    env.pop("VLLM_API_KEY")
    proc = subprocess.Popen(pool._argv(port), stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def start_tandem(hf: Path, python: str, max_batch: int, run_dir: Path) -> tuple[subprocess.Popen, str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", str(hf), "--engine", "vllm", "--replicas", "1",
                             "--port", "0", "--run-dir", str(run_dir), "--max-batch", str(max_batch),
                             "--vllm-python", python, "--threads", "1", "--served-model-name", "tandem",
                             "--max-queue", "4096"],
                            stdout=open(run_dir / "front.log", "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, start_new_session=True)
    info = run_dir / "server.json"
    while not info.is_file():   # written before the replicas load; bounded by the /health wait below
        if proc.poll() is not None:
            raise SystemExit(f"tandem serve exited {proc.returncode}: {(run_dir / 'front.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, json.loads(info.read_text())["url"]


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid`` (/proc):
    what a side costs the machine, whatever else shares its cores."""
    tck, total = os.sysconf("SC_CLK_TCK"), 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[2]) == pgid:
                total += int(f[11]) + int(f[12])
    return total / tck


def wait_ready(url: str, path: str, proc: subprocess.Popen, timeout_s: float) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{url}{path} not 200 within {timeout_s:g} s")


async def closed_loop(url: str, model: str, prompts: list[list[int]], requests: int, concurrency: int,
                      max_tokens: int) -> dict:
    import httpx

    parts = httpx.URL(url)
    client = _SSEClient(parts.host, parts.port, {})
    loop = asyncio.get_running_loop()
    rows: list[dict] = []
    nxt = iter(range(requests))

    async def worker() -> None:
        for i in nxt:
            body = json.dumps({"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                               "stream_options": {"include_usage": True}}).encode()
            t = loop.time()
            code, events, _ = await client.post_events("/v1/completions", body, 120, loop)
            first, tokens = None, 0
            for at, data in events:
                if data == b"[DONE]":
                    continue
                ev = json.loads(data)
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
                if first is None and any(c.get("text") or c.get("token_ids") for c in ev.get("choices") or ()):
                    first = at
            ok = code == "200" and bool(events) and events[-1][1] == b"[DONE]"
            rows.append({"ok": ok, "code": code, "ttft": (first - t) if first else None, "tokens": tokens})

    t0 = loop.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    span = loop.time() - t0
    client.close()
    ok = [r for r in rows if r["ok"]]
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    return {"requests": len(rows), "ok": len(ok), "seconds": span, "rps": len(ok) / span,
            "tok_s": sum(r["tokens"] for r in ok) / span, "ttft_p50_ms": 1000 * percentile(ttft, 50),
            "ttft_p99_ms": 1000 * percentile(ttft, 99), "codes": sorted({r["code"] for r in rows})}


def main() -> None:
    from tandem.serve.vllm_engine import find_python, hf_model_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf", type=Path)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200, help="per round and side")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=32, help="vLLM's --max-num-seqs, both sides")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    hf = args.hf.resolve()
    info, _ = hf_model_info(hf)
    python = find_python(args.vllm_python)
    n = info.seq // 2   # the reverse task's prompt (tandem/train/tasks.py): n digits and the separator 10
    prompts = [[(7 * i + 3 * j) % 10 for j in range(n)] + [10] for i in range(16)]
    max_tokens = min(args.max_tokens, info.seq + 1 - len(prompts[0]))
    tmp = Path(tempfile.mkdtemp(prefix="svv-"))
    procs = []
    try:
        t0 = time.monotonic()
        bare, b_url = start_bare(hf, python, args.max_batch, tmp / "bare.log")
        procs.append(bare)
        tandem, t_url = start_tandem(hf, python, args.max_batch, tmp / "tandem")
        procs.append(tandem)
        up = {"bare": wait_ready(b_url, "/health", bare, 900), "tandem": wait_ready(t_url, "/readyz", tandem, 900)}
        print(f"{hf}: bare vLLM at {b_url} (health after {up['bare']:.0f} s), tandem --engine vllm at {t_url} "
              f"(ready {time.monotonic() - t0:.0f} s after both started); 1 replica each, concurrency "
              f"{args.concurrency}, {args.requests} requests per round, {max_tokens} tokens each, prompts of "
              f"{len(prompts[0])}; {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}", flush=True)
        sides = {"bare": (b_url, "bare"), "tandem": (t_url, "tandem")}
        for name, (url, model) in sides.items():   # warm-up
            asyncio.run(closed_loop(url, model, prompts, 2 * args.concurrency, args.concurrency, max_tokens))
        # CPU per request, by process group: bare vLLM's (API server, EngineCore, worker); tandem's front
        # (its own group) and its replica's (the same three vLLM processes)
        rep_pid = json.loads((tmp / "tandem" / "replicas.json").read_text())["replicas"][0]["pid"]
        groups = {"bare": {"vllm": bare.pid}, "tandem": {"front": tandem.pid, "vllm": rep_pid}}
        res: dict[str, list[dict]] = {"bare": [], "tandem": []}
        for rnd in range(args.rounds):
            for name in (("bare", "tandem") if rnd % 2 == 0 else ("tandem", "bare")):
                url, model = sides[name]
                before = {k: group_cpu_s(g) for k, g in groups[name].items()}
                r = asyncio.run(closed_loop(url, model, prompts, args.requests, args.concurrency, max_tokens))
                r["cpu_ms_per_req"] = {k: 1000 * (group_cpu_s(g) - before[k]) / max(1, r["ok"])
                                       for k, g in groups[name].items()}
                res[name].append(r)
                cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_ms_per_req"].items())
                print(f"  round {rnd + 1} {name:6s}: {r['ok']}/{r['requests']} ok, {r['rps']:.1f} req/s, "
                      f"{r['tok_s']:.0f} tok/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms; "
                      f"CPU ms/request: {cpu}", flush=True)
        tot = {k: {"rps": sum(r["ok"] for r in v) / sum(r["seconds"] for r in v),
                   "tok_s": sum(r["tok_s"] * r["seconds"] for r in v) / sum(r["seconds"] for r in v),
                   "ttft_p50_ms": sorted(r["ttft_p50_ms"] for r in v)[len(v) // 2],
                   "ttft_p99_ms": sorted(r["ttft_p99_ms"] for r in v)[len(v) // 2],
                   "failed": sum(r["requests"] - r["ok"] for r in v)} for k, v in res.items()}
        for k, v in res.items():
            tot[k]["cpu_ms_per_req"] = {g: sorted(r["cpu_ms_per_req"][g] for r in v)[len(v) // 2] for g in groups[k]}
        ratio = tot["tandem"]["rps"] / tot["bare"]["rps"]
        for k, v in tot.items():
            print(f"{k:6s}: {v['rps']:.1f} req/s, {v['tok_s']:.0f} output tok/s, TTFT p50 {v['ttft_p50_ms']:.1f} ms, "
                  f"p99 {v['ttft_p99_ms']:.1f} ms (median of rounds), {v['failed']} failed; CPU ms/request (median) "
                  + ", ".join(f"{g} {c:.1f}" for g, c in v["cpu_ms_per_req"].items()))
        front = tot["tandem"]["cpu_ms_per_req"]["front"]
        print(f"ratio tandem / bare: {ratio:.3f} of the requests/s ({100 * (1 - ratio):+.1f}% cost; target <= 5%), "
              f"{tot['tandem']['tok_s'] / tot['bare']['tok_s']:.3f} of the tokens/s, TTFT p50 x"
              f"{tot['tandem']['ttft_p50_ms'] / tot['bare']['ttft_p50_ms']:.2f}; the front's CPU per request is "
              f"{100 * front / tot['bare']['cpu_ms_per_req']['vllm']:.0f}% of bare vLLM's")
        if args.json:
            args.json.write_text(json.dumps({"rounds": res, "total": tot, "ratio_rps": ratio, "startup_s": up,
                                             "concurrency": args.concurrency, "max_tokens": max_tokens}, indent=1))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        try:   # what is left of bare vLLM's group (its EngineCore)
            os.killpg(procs[0].pid, signal.SIGKILL)
        except (ProcessLookupError, IndexError, PermissionError):
            pass


if __name__ == "__main__":
    main()
