"""tandem's local engine against a plain Ray Serve deployment of the same export, on this machine.

    python bench/serve_vs_ray.py EXPORT_DIR [--duration 4] [--p99-ms 500] [--start-rate 10] [--json FILE]

Both serve a classifier export with 2 replicas of one torch thread each, batching up to 32 examples
with a 5 ms wait:
  tandem  `tandem serve EXPORT_DIR --replicas 2` (front process + 2 replica processes)
  ray     a local Ray instance running the deployment the Ray Serve docs show: a class with
          `@serve.deployment(num_replicas=2)`, `__call__(request)` reading the JSON body and awaiting an
          `@serve.batch` method that runs the model (`tandem.export.load`), behind Ray's HTTP proxy
Both get the same open-loop load (`tandem bench serve`'s generator, the same request body) at the
same rates, stepped up x1.5, alternating between the two at each rate. A rate is sustained when every
request is answered 200, the p99 from the intended send time is within --p99-ms and latency does not
climb through the run (tandem/bench/serve_batching.py's `step_rates` and `sustained`); capacity is the
highest rate sustained. Then, at half the smaller capacity, each gets 8 s of load with one replica SIGKILLed 3 s
in. Printed: capacity(tandem) / capacity(ray) at the same p99 bound, and the failed fraction of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")   # see tandem/serve/ray_engine.py

from tandem.bench.serve import run_load  # noqa: E402
from tandem.bench.serve_batching import _start, _stop, step_rates  # noqa: E402

APP = "plain"


def start_ray(export: Path) -> str:
    """A local Ray instance (own temp dir) serving the export the documented Ray Serve way."""
    import ray
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 1})
    class Model:
        def __init__(self, export_dir: str):
            import torch

            import tandem.export

            torch.set_num_threads(1)
            self.torch, self.model = torch, tandem.export.load(export_dir)

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
        async def run(self, inputs: list[list]) -> list[list]:
            x = self.torch.tensor([ex for xs in inputs for ex in xs])
            with self.torch.no_grad():
                y = self.model(x)
            out, i = [], 0
            for xs in inputs:
                out.append(y[i:i + len(xs)].tolist())
                i += len(xs)
            return out

        async def __call__(self, request: Request) -> dict:
            body = await request.json()
            return {"outputs": await self.run(body["inputs"])}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Model.bind(str(export)), name=APP, route_prefix="/v1/predict")
    return f"http://127.0.0.1:{port}"


async def kill_ray_replica_at(t: float) -> int:
    from ray._private import state

    await asyncio.sleep(t)
    pid = next(a["Pid"] for a in state.actors().values()
               if a.get("Name", "").startswith(f"SERVE_REPLICA::{APP}#") and a["State"] == "ALIVE")
    os.kill(pid, signal.SIGKILL)
    return pid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds of load per rate")
    ap.add_argument("--p99-ms", type=float, default=500.0)
    ap.add_argument("--start-rate", type=float, default=10.0)
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    export = args.export.resolve()
    tmp = tempfile.mkdtemp(prefix="svr-", dir="/tmp")   # short: Ray's socket paths
    os.environ["RAY_TMPDIR"] = tmp
    proc = None
    try:
        proc, t_url = _start(export, Path(tmp) / "tandem", 32, 5.0, ("--replicas", "2"))
        r_url = start_ray(export)
        import httpx

        info = httpx.get(f"{t_url}/v1/info").json()
        assert info["model"]["kind"] == "classifier", "this bench takes a classifier export (/v1/predict)"
        urls = {"tandem": t_url, "ray": r_url}
        print(f"{export}: tandem at {t_url}, plain Ray Serve at {r_url}; 2 replicas each, max batch 32, 5 ms "
              f"wait; open loop, {args.duration:g} s per rate, p99 bound {args.p99_ms:g} ms; {os.cpu_count()} "
              f"cpus", flush=True)
        cap = step_rates(urls, start_rate=args.start_rate, max_steps=args.max_steps, duration=args.duration,
                         p99_ms=args.p99_ms, say=lambda m: print(m, flush=True), info=info)
        kill_rate = max(args.start_rate, 0.5 * min(cap["capacity_rps"].values()))
        kills = {}
        for k, url in urls.items():
            if k == "tandem":
                res = asyncio.run(run_load(url, kill_rate, 8.0, kill_at=3.0, timeout_s=60,
                                             run_dir=Path(tmp) / "tandem"))
            else:
                async def both():
                    return await asyncio.gather(run_load(url, kill_rate, 8.0, info=info, timeout_s=60),
                                                kill_ray_replica_at(3.05))
                res, pid = asyncio.run(both())
                res["kill"] = {"pid": pid}
            kills[k] = {"sent": res["sent"], "failed": res["failed"], "codes": res["codes"],
                        "p99_ms": res["latency_ms"]["p99"], "killed": res["kill"]}
            print(f"kill one replica 3 s into 8 s at {kill_rate:.1f} req/s: {k}: {res['failed']} of {res['sent']} "
                  f"failed (codes {res['codes']}); killed {res['kill']}", flush=True)
            if k == "tandem" and res["failed"]:   # what the front saw
                print((Path(tmp) / "tandem" / "front.log").read_text()[-1500:], flush=True)
        c = cap["capacity_rps"]
        ratio = c["tandem"] / c["ray"] if c["ray"] else float("nan")
        more = {k: " (or more)" if k in cap["still_sustaining"] else "" for k in c}
        print(f"capacity at p99 <= {args.p99_ms:g} ms: tandem {c['tandem']:.1f}{more['tandem']} req/s, plain Ray Serve "
              f"{c['ray']:.1f}{more['ray']} req/s; ratio tandem/ray {ratio:.2f}x")
        fr = {k: v["failed"] / max(1, v["sent"]) for k, v in kills.items()}
        print(f"failed requests with a replica killed: tandem {fr['tandem']:.3f} ({kills['tandem']['failed']}/"
              f"{kills['tandem']['sent']}), plain Ray Serve {fr['ray']:.3f} ({kills['ray']['failed']}/"
              f"{kills['ray']['sent']})")
        if args.json:
            args.json.write_text(json.dumps({"export": str(export), **cap, "ratio": ratio, "kill_rate": kill_rate,
                                             "kill": kills, "p99_ms": args.p99_ms, "duration_s": args.duration,
                                             "cpus": os.cpu_count()}, indent=1) + "\n")
    finally:
        if proc is not None:
            _stop(proc)
        try:
            import ray

            if ray.is_initialized():
                from ray import serve

                serve.shutdown()
                ray.shutdown()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
