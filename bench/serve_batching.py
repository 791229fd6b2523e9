"""The local engine's continuous batching under concurrency: this tree against a baseline commit, one run.

    python bench/serve_batching.py [EXPORT_DIR] [--baseline REF] [--concurrency 1,8,32] [--requests 4]
                                   [--replicas 1] [--max-batch 32] [--threads 1] [--json FILE]

Without EXPORT_DIR it writes and exports the model issue 31 measured: a GPT of 10.8M parameters (6 layers,
hidden 384, 6 heads of 64, vocab 256 byte-level, 256 positions), seeded weights, its output layer
untied with the rows of the bytes >= 128 zeroed, so that greedy replies are ASCII and stream a chunk per
token (an untrained model's non-UTF-8 bytes would be held back to the end and show no inter-token
latency).

Each server is a real `tandem serve` over loopback (this tree's code; ``--baseline REF``: a second server
running the code of git commit REF, extracted with `git archive` into a temporary folder). At each
concurrency N, N closed-loop clients send --requests x N streamed greedy `/v1/completions` requests in
all (token-id prompts of 64-128 bytes, 32-64 new tokens, eos ignored; the same seeded list for both
servers), the two servers alternating at each N so that drift on a shared machine hits both. Printed per
server and N: requests/s, output tokens/s, time to first token p50/p99 (send -> first text chunk),
inter-token latency p50/p99 (the gaps between a stream's chunks), latency p50/p99, and the ratio
tree / baseline of each; and each server's start-up (spawn -> ready) time. Outputs are compared:
greedy tokens of the two servers must be equal.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.bench.serve import _SSEClient, percentile  # noqa: E402
from tandem.bench.serve_batching import _stop as stop  # noqa: E402  (SIGTERM, then kill after 60 s)

print = functools.partial(print, flush=True)   # progress shows while the run goes on

SHAPE = dict(layers=6, hidden=384, heads=6, kv_heads=6, seq=256, vocab=256, tied=False)


def make_export(root: Path) -> Path:
    """The issue's model as a `tandem export` folder (see the module docstring)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from export.export_helpers import write_checkpoint
    from tandem.cli import main

    def ascii_only(sd):
        sd["head.weight"][128:] = 0.0

    run = write_checkpoint(root / "run", model_overrides=SHAPE, mutate=ascii_only)
    try:
        main(["export", str(run), "--out", str(root / "export")])
    except SystemExit as e:
        if e.code:
            raise
    return root / "export"


def start(code: Path, export: Path, run_dir: Path, a) -> tuple[subprocess.Popen, str, float]:
    """`tandem serve` on the code in ``code``; (process, url, seconds from spawn to ready)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "front.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", str(export), "--port", "0", "--run-dir",
                             str(run_dir), "--max-batch", str(a.max_batch), "--replicas", str(a.replicas),
                             "--threads", str(a.threads), "--max-queue", "4096"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=code,
                            env={**os.environ, "PYTHONPATH": str(code)})
    info, end = run_dir / "server.json", time.monotonic() + 300
    while time.monotonic() < end and proc.poll() is None:
        if info.is_file() and "ready:" in (run_dir / "front.log").read_text():
            return proc, json.loads(info.read_text())["url"], time.monotonic() - t0
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"server of {code} did not become ready: {(run_dir / 'front.log').read_text()[-800:]}")


def cpu_s(run_dir: Path, front: int) -> tuple[float, float]:
    """CPU seconds the front and its replicas have used so far (/proc; on a machine shared with other
    work, CPU per token is steadier than wall time)."""
    reps = [r["pid"] for r in json.loads((run_dir / "replicas.json").read_text())["replicas"] if r["pid"]]
    tick = os.sysconf("SC_CLK_TCK")

    def used(pid: int) -> float:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError):
            return 0.0
    return used(front), sum(used(p) for p in reps)


def requests(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(32, 127) for _ in range(rng.randrange(64, 129))],
             "max_tokens": rng.randrange(32, 65)} for _ in range(n)]


async def closed_loop(url: str, reqs: list[dict], concurrency: int, timeout_s: float = 300.0) -> dict:
    """``concurrency`` clients, each sending the next request of ``reqs`` when its last one is answered."""
    import httpx

    parts = httpx.URL(url)
    async with httpx.AsyncClient(timeout=30) as c:
        model = (await c.get(f"{url}/v1/models")).json()["data"][0]["id"]
    loop = asyncio.get_running_loop()
    client = _SSEClient(parts.host, parts.port, {})
    todo = list(enumerate(reqs))[::-1]
    rows: dict[int, dict] = {}

    async def worker() -> None:
        while todo:
            i, r = todo.pop()
            body = json.dumps({"model": model, "prompt": r["prompt"], "max_tokens": r["max_tokens"],
                               "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}).encode()
            sent = loop.time()
            code, events, _ = await client.post_events("/v1/completions", body, timeout_s, loop)
            row = {"code": code, "latency": loop.time() - sent, "ttft": None, "gaps": [], "tokens": 0, "text": ""}
            if code == "200":
                docs = [(t, json.loads(d)) for t, d in events if d != b"[DONE]"]
                texts = [(t, d["choices"][0]["text"]) for t, d in docs if d.get("choices")]
                usage = [d["usage"] for _, d in docs if d.get("usage")]
                row["ttft"] = texts[0][0] - sent if texts else None
                row["gaps"] = [b[0] - a[0] for a, b in zip(texts, texts[1:])]
                row["tokens"] = usage[-1]["completion_tokens"] if usage else 0
                row["text"] = "".join(x for _, x in texts)
                if not events or events[-1][1] != b"[DONE]":
                    row["code"] = "truncated"
            rows[i] = row

    t0 = loop.time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    span = loop.time() - t0
    client.close()
    ok = [rows[i] for i in sorted(rows) if rows[i]["code"] == "200"]
    ms = lambda xs, q: 1000 * percentile(sorted(xs), q)  # noqa: E731
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [g for r in ok for g in r["gaps"]]
    lat = [r["latency"] for r in ok]
    return {"concurrency": concurrency, "sent": len(reqs), "ok": len(ok), "span_s": span,
            "rps": len(ok) / span, "tokens_per_s": sum(r["tokens"] for r in ok) / span,
            "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)}, "itl_ms": {"p50": ms(itl, 50), "p99": ms(itl, 99)},
            "latency_ms": {"p50": ms(lat, 50), "p99": ms(lat, 99)},
            "texts": [rows[i]["text"] for i in sorted(rows)]}


def line(name: str, r: dict) -> str:
    return (f"  {name:<9} {r['rps']:6.2f} req/s {r['tokens_per_s']:7.0f} tok/s {r['cpu_ms_per_token']:5.1f} cpu-ms/tok "
            f"({r['replica_cpu_ms_per_token']:.1f} replicas)  ttft p50 {r['ttft_ms']['p50']:7.0f} "
            f"p99 {r['ttft_ms']['p99']:7.0f} ms  itl p50 {r['itl_ms']['p50']:6.1f} p99 {r['itl_ms']['p99']:6.1f} ms  "
            f"latency p50 {r['latency_ms']['p50']:7.0f} p99 {r['latency_ms']['p99']:7.0f} ms  ({r['ok']}/{r['sent']} ok)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path, nargs="?")
    ap.add_argument("--baseline", help="a git commit (e.g. main) whose engine runs beside this tree's")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=4, help="requests per client at each concurrency")
    ap.add_argument("--min-requests", type=int, default=12)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="serve-batching-"))
    export = a.export or make_export(tmp / "model")
    codes = {"tree": ROOT}
    if a.baseline:
        base = tmp / "baseline"
        base.mkdir()
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", a.baseline], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=arch, check=True)
        codes["baseline"] = base
    servers, out = {}, {"export": str(export), "baseline": a.baseline, "replicas": a.replicas,
                        "max_batch": a.max_batch, "threads": a.threads, "startup_s": {}, "runs": []}
    try:
        for name, code in codes.items():
            proc, url, up = start(code, export, tmp / f"run-{name}", a)
            servers[name] = (proc, url)
            out["startup_s"][name] = up
        print(f"export {export}; {a.replicas} replica(s), --max-batch {a.max_batch}, {a.threads} thread(s) each")
        print("start-up (spawn -> ready): " + ", ".join(f"{k} {v:.1f} s" for k, v in out["startup_s"].items()))
        for c in (int(x) for x in a.concurrency.split(",")):
            reqs = requests(max(a.min_requests, a.requests * c), seed=c)
            asyncio.run(closed_loop(servers["tree"][1], requests(2, 99), 2))   # warm both the same way
            row = {"concurrency": c}
            for name in (codes if c % 2 else list(codes)[::-1]):   # alternate which goes first
                if name != "tree":
                    asyncio.run(closed_loop(servers[name][1], requests(2, 99), 2))
                cpu0 = cpu_s(tmp / f"run-{name}", servers[name][0].pid)
                row[name] = asyncio.run(closed_loop(servers[name][1], reqs, c))
                toks = row[name]["tokens_per_s"] * row[name]["span_s"]
                cpu1 = cpu_s(tmp / f"run-{name}", servers[name][0].pid)
                row[name]["cpu_ms_per_token"] = 1000 * (sum(cpu1) - sum(cpu0)) / max(toks, 1)
                row[name]["replica_cpu_ms_per_token"] = 1000 * (cpu1[1] - cpu0[1]) / max(toks, 1)
            print(f"concurrency {c}: {len(reqs)} requests, {sum(r['max_tokens'] for r in reqs)} new tokens asked")
            for name in codes:
                print(line(name, row[name]))
            if "baseline" in row:
                t, b = row["tree"], row["baseline"]
                same = t["texts"] == b["texts"]
                print(f"  tree/baseline: req/s {t['rps'] / b['rps']:.2f}x, "
                      f"tok/s {t['tokens_per_s'] / b['tokens_per_s']:.2f}x, "
                      f"latency p99 {t['latency_ms']['p99'] / b['latency_ms']['p99']:.2f}x, "
                      f"ttft p99 {t['ttft_ms']['p99'] / b['ttft_ms']['p99']:.2f}x, cpu/token "
                      f"{t['cpu_ms_per_token'] / b['cpu_ms_per_token']:.2f}x; same greedy outputs: {same}")
                row["same_outputs"] = same
            for name in codes:
                row[name].pop("texts")
            out["runs"].append(row)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
