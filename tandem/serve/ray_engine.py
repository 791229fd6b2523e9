"""`tandem serve EXPORT --engine ray`: the same front, with its replicas as a Ray Serve deployment.

    tandem serve process: the front of app.py (routes, schemas, codes, metrics, drain)
        --DeploymentHandle-->  Ray Serve deployment "model" of `RayReplica`, N replicas spread over the nodes

The front is the local engine's (app.build_app over RayPool instead of pool.Pool), so routes, bodies,
bad-input codes, 429/504/503 and /metrics are the same; only what stands behind ``submit`` differs.
Each replica loads the export with ``tandem.export.load``, runs the warm-up forward before Ray Serve
counts it RUNNING, and answers with replica.py's ``predict`` / ``generate`` under Ray's ``@serve.batch``.
A request whose replica dies (Ray's handle raises RayActorError) is sent again (inference is
idempotent) and Ray Serve starts a replacement replica.

tandem's flags map onto the deployment's options in ``deployment_options`` (plain data, built without
Ray, so the mapping is tested without a cluster); ``ray_pool_factory`` refuses what the Ray engine
cannot do before anything starts.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import shutil
import tempfile
import time

import numpy as np

# Ray's driver installs absl's failure-signal handler on SIGTERM too: it prints a stack and arms an alarm
# that aborts the process seconds later, in the middle of the drain and the teardown. Read at `import ray`.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
try:
    from ray import serve  # noqa: E402
except ImportError:  # the `ray` extra is not installed: ray_pool_factory says so in one line first
    serve = None


def _batch(fn):
    """Ray Serve's @serve.batch (the module stays importable without Ray: ray_pool_factory names the extra)."""
    return serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)(fn) if serve is not None else fn


from tandem.core.errors import ConfigError
from tandem.core.ray_address import check_ray_address
from tandem.serve.engine import Engine
from tandem.serve.metrics import Metrics
from tandem.serve.pool import DeadlineExceeded, PoolOptions, QueueFull, ReplicaError, RequestFailed

DEPLOYMENT = "model"
DTYPES = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}


class RayReplica:
    """One Ray Serve replica: the export loaded once, warmed up in the constructor (Ray Serve counts a
    replica RUNNING only after it returns), then replica.py's forward/generate on Ray's batches."""

    def __init__(self, export: str, threads: int, max_batch: int, batch_wait_s: float):
        import ray
        import torch

        import tandem.export
        from tandem.export import format as fmt
        from tandem.export.loader import read_config
        from tandem.serve import kvcache

        torch.set_num_threads(max(1, threads))
        self.torch = torch
        self.model = tandem.export.load(export, device="cpu")
        with torch.no_grad():
            y = self.model(fmt.make_input(read_config(export)["example_input"]))
        if not torch.isfinite(y.float()).all():
            raise RuntimeError("warm-up forward gave non-finite outputs")
        self.cached = kvcache.supports(self.model)
        self.where = {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}
        for m in (self.predict, self.generate):
            m.set_max_batch_size(max_batch)
            m.set_batch_wait_timeout_s(batch_wait_s)

    def info(self) -> dict:
        return self.where

    @_batch
    async def predict(self, items: list[dict]) -> list[dict]:
        from tandem.serve import replica

        now, out = time.time(), [None] * len(items)
        live = [i for i, it in enumerate(items) if not 0 < it["deadline"] < now]
        if live:
            xs = [np.frombuffer(items[i]["raw"], dtype=DTYPES[items[i]["dtype"]]).reshape(items[i]["shape"])
                  for i in live]
            y = replica.predict(self.model, self.torch, self.torch.from_numpy(np.concatenate(xs))).numpy()
            at = 0
            for i, x in zip(live, xs):
                part = np.ascontiguousarray(y[at:at + len(x)], dtype="<f4")
                # the batch's size rides on its first answer only: /metrics counts batches, not requests
                out[i] = {"raw": part.tobytes(), "shape": list(part.shape), "batch": len(live) if i == live[0] else 0}
                at += len(x)
        return [o if o is not None else {"expired": True} for o in out]

    @_batch
    async def generate(self, items: list[dict]) -> list[dict]:
        from tandem.serve import replica

        now, out = time.time(), [{"expired": True}] * len(items)
        live = [i for i, it in enumerate(items) if not 0 < it["deadline"] < now]
        if live:
            run = replica.generate_cached if self.cached else replica.generate
            toks = run(self.model, self.torch, [items[i]["request"] for i in live])
            for i, t in zip(live, toks):
                out[i] = {"tokens": t, "batch": len(live) if i == live[0] else 0}
        return out


class _Where:
    def __init__(self, pid: int):
        self.pid = pid


class RayPool(Engine):
    """What app.py's handlers need of a pool (submit, o, active, ready_count), on a Ray Serve app.

    The queue bound is on requests sent to Ray and not yet answered (Ray's own queues hold them);
    each is sent again after a RayActorError until --hang-s has passed since it arrived."""

    def __init__(self, opts: PoolOptions, metrics: Metrics, say=print, address: str | None = None):
        self.o, self.m, self.say, self.address = opts, metrics, say, address
        self.active, self.ready_count, self.live = opts.replicas, 0, []
        self.app = f"tandem-{_model_name(opts)}-{os.getpid()}"
        self.inflight = 0
        self.dead: set[str] = set()
        self.handle = None
        self._own_tmp: str | None = None
        self._watcher: asyncio.Task | None = None
        self._closed = False
        self.draining = False
        self._aborted: str | None = None
        self._tasks: set[asyncio.Task] = set()   # the submits awaiting Ray (abort cancels them)

    # ---- lifecycle ----
    async def start(self) -> None:
        try:
            await asyncio.wait_for(asyncio.to_thread(self._deploy), self.o.load_timeout_s)
        except asyncio.TimeoutError:
            raise ReplicaError(f"{self.o.replicas} replica(s) not running after {self.o.load_timeout_s:g} s "
                               f"(does the cluster have {self.o.replicas} free CPUs?)") from None
        except ReplicaError:
            raise
        except Exception as e:   # the deployment failed (a replica's constructor raised)
            raise ReplicaError(f"Ray Serve could not deploy the export: {type(e).__name__}: "
                               f"{str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}") from None
        await asyncio.to_thread(self._refresh)
        self._watcher = asyncio.create_task(self._watch())

    def _deploy(self) -> None:
        import ray

        if self.address:
            ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
        else:
            # a Ray instance of our own: its own temp dir, so neither its address file nor its sockets
            # meet another Ray instance on this machine (plain ray.init() would join one found there)
            self._own_tmp = tempfile.mkdtemp(prefix="tandem-ray-")
            os.environ["RAY_TMPDIR"] = self._own_tmp
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, self.o.replicas), include_dashboard=False,
                     logging_level="WARNING", log_to_driver=False)
        for attempt in range(5):   # HTTP is the tandem front's, not Ray's proxy
            try:
                serve.start(proxy_location="Disabled")
                break
            except ray.exceptions.ActorAlreadyExistsError:   # another front started Serve at the same moment
                time.sleep(1 + attempt)
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        opt = deployment_options(self.o, nodes)
        auto = opt.get("autoscaling_config")
        what = f"{self.o.replicas} replica(s)" if auto is None else \
            (f"{auto['min_replicas']}..{auto['max_replicas']} replicas (Ray Serve autoscaling, target "
             f"{auto['target_ongoing_requests']} ongoing requests per replica)")
        self.say(f"serve: Ray cluster of {nodes} node(s); deploying {what}, at most "
                 f"{opt['max_replicas_per_node']} per node, as Ray Serve app {self.app}")
        dep = serve.deployment(RayReplica).options(name=DEPLOYMENT, **opt)
        self.handle = serve.run(dep.bind(str(self.o.export), self.o.threads, self.o.max_batch,
                                         self.o.batch_wait_ms / 1000), name=self.app, route_prefix=None)

    async def close(self) -> None:
        self._closed = True
        if self._watcher:   # not cancelled: a serve.status() call still running in its thread beside
            await self._watcher   # serve.delete() aborted the process
        self._teardown()   # in the main thread: ray.shutdown() from another thread aborted the process

    def _teardown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        try:
            serve.delete(self.app)
            if not self.address:
                serve.shutdown()
        finally:
            ray.shutdown()
            if self._own_tmp:
                shutil.rmtree(self._own_tmp, ignore_errors=True)

    async def _watch(self) -> None:
        while True:
            for _ in range(10):
                await asyncio.sleep(0.1)
                if self._closed:
                    return
            try:
                await asyncio.to_thread(self._refresh)
            except Exception as e:  # the controller busy or restarting: keep the last view
                self.say(f"serve: Ray Serve status unavailable ({type(e).__name__})")

    def _refresh(self) -> None:
        """Replicas RUNNING (for /readyz) and their pids and nodes (RUN_DIR/replicas.json)."""
        from ray._private import state

        app = serve.status().applications.get(self.app)
        dep = app.deployments[DEPLOYMENT] if app else None
        running = dep.replica_states.get("RUNNING", 0) if dep else 0
        prefix = f"SERVE_REPLICA::{self.app}#{DEPLOYMENT}#"
        reps = [{"slot": i, "pid": a.get("Pid"), "node": a["Address"]["NodeID"], "ready": True,
                 "replica": a["Name"][len(prefix):]}
                for i, a in enumerate(sorted((a for a in state.actors().values()
                                              if a.get("Name", "").startswith(prefix) and a["State"] == "ALIVE"),
                                             key=lambda a: a["Name"]))]
        self.ready_count = min(running, len(reps)) if reps else running
        if self.o.scale and dep is not None:
            # Ray Serve's target: replicas not stopping. Counted only when its autoscaler moved it, so that
            # a dead replica being replaced (HEALTH_CHECK_FAILED, ...) does not read as a scale-down
            target = sum(n for st, n in dep.replica_states.items() if st != "STOPPING")
            if target != self.active and target >= self.o.scale.min_replicas and (
                    dep.status in ("UPSCALING", "DOWNSCALING") or
                    dep.status_trigger in ("AUTOSCALING", "UPSCALE_COMPLETED", "DOWNSCALE_COMPLETED")):
                self._scaled(self.active, target)
        self.live = [_Where(r["pid"]) for r in reps]
        self.m.replicas_ready.set(self.ready_count)
        self.m.replicas_target.set(self.active)
        self.o.run_dir.mkdir(parents=True, exist_ok=True)
        doc = {"front_pid": os.getpid(), "export": str(self.o.export), "engine": "ray", "app": self.app,
               "replicas": reps[:self.active] if len(reps) >= self.active else
               reps + [{"slot": i, "pid": None, "ready": False} for i in range(len(reps), self.active)]}
        path = self.o.run_dir / "replicas.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)

    def _scaled(self, before: int, after: int) -> None:
        """Ray Serve's autoscaler moved the replica count: print it and log it as the local engine does."""
        direction = "up" if after > before else "down"
        reason = (f"Ray Serve autoscaler: {self.inflight} request(s) in flight against a target of "
                  f"{self.o.scale.up_queue} per replica")
        self.active = after
        self.say(f"autoscale: {before} -> {after} replica(s): {reason}")
        self.o.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.o.run_dir / "autoscale.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "direction": direction, "before": before, "after": after,
                                "reason": reason, "signal": "ray", "queue_depth": self.inflight}) + "\n")
        self.m.scale_decisions.labels(direction, "ray").inc()

    def drain(self) -> None:
        """SIGTERM: Ray Serve owns the replicas' lifecycle; nothing to stop here."""
        self.draining = True

    def abort(self, why: str) -> None:
        """The end of a drain: every submit still awaiting Ray raises ReplicaError(why) (a 503)."""
        self._aborted = why
        for t in list(self._tasks):
            t.cancel()

    # ---- requests ----
    streams = False   # Ray's handle answers a request whole: a sink gets its tokens at the end

    def ready_pids(self) -> list[int]:
        return [r.pid for r in self.live if r is not None]

    async def submit(self, kind: str, payload, size: int, timeout_ms: int = 0, sink=None):
        from ray.exceptions import RayActorError, RayTaskError

        if self.inflight >= self.o.max_queue:
            raise QueueFull()
        t0 = time.monotonic()
        deadline = time.time() + timeout_ms / 1000 if timeout_ms else 0.0
        if kind == "predict":
            x = np.ascontiguousarray(payload)
            item = {"raw": x.tobytes(), "shape": list(x.shape), "dtype": x.dtype.name, "deadline": deadline}
        else:
            item = {"request": payload, "deadline": deadline}
        self.inflight += 1
        self.m.queue_depth.set(self.inflight)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            delay = 0.05
            while True:
                try:
                    out = await asyncio.wait_for(getattr(self.handle, kind).remote(item), self.o.hang_s)
                    break
                except (RayActorError, asyncio.TimeoutError) as e:
                    # the replica died (or hung) with the request: Ray Serve replaces it; send it again
                    aid = getattr(e, "actor_id", None) or type(e).__name__
                    if aid not in self.dead and isinstance(e, RayActorError):
                        self.dead.add(aid)
                        self.m.restarts.inc()
                    self.m.retries.inc()
                    if time.monotonic() - t0 > self.o.hang_s:
                        raise ReplicaError(f"replicas kept failing for {self.o.hang_s:g} s "
                                           f"({type(e).__name__})") from None
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 1.0)
                except RayTaskError as e:   # this request failed on a live replica: a 500, not retried
                    raise RequestFailed(secrets.token_hex(6), str(e).strip().splitlines()[-1][:300]) from None
        except asyncio.CancelledError:
            if self._aborted is None:
                raise
            task.uncancel()   # our own cancel (abort): the request is answered 503, its handler goes on
            raise ReplicaError(self._aborted) from None
        finally:
            self._tasks.discard(task)
            self.inflight -= 1
            self.m.queue_depth.set(self.inflight)
        if out.get("expired"):
            raise DeadlineExceeded(f"timeout_ms {timeout_ms} passed before a replica took the request")
        if out["batch"]:
            self.m.batch_size.labels(kind).observe(out["batch"])
        if kind == "predict":
            return np.frombuffer(out["raw"], dtype="<f4").reshape(out["shape"])
        self.m.tokens.inc(len(out["tokens"]))
        return out["tokens"]


def _model_name(opts: PoolOptions) -> str:
    try:
        return json.loads((opts.export / "config.json").read_text())["model"]["name"].replace(":", "-")
    except (OSError, ValueError, KeyError):
        return "export"


def deployment_options(opts, nodes: int) -> dict:
    """``serve.deployment(...).options(**this)`` for a PoolOptions on a cluster of ``nodes``.

    A fixed ``--replicas N`` is ``num_replicas=N``. ``--replicas MIN:MAX`` hands the decisions to Ray
    Serve's autoscaler: ``autoscaling_config`` with MIN..MAX replicas (starting at MIN), a target of
    ``--scale-up-queue`` ongoing requests per replica (0: --max-batch, as on the local engine), and
    --scale-up-s / --scale-down-s as its upscale / downscale delays. Replicas are spread: at most
    ceil(N or MAX / nodes) on one node."""
    sc = opts.scale
    most = sc.max_replicas if sc else opts.replicas
    out = {"max_replicas_per_node": math.ceil(most / max(1, nodes)),
           "max_ongoing_requests": max(8, 2 * opts.max_batch), "health_check_period_s": 2,
           "health_check_timeout_s": max(10.0, opts.hang_s), "ray_actor_options": {"num_cpus": 1}}
    if sc is None:
        return out | {"num_replicas": opts.replicas}
    # a replica may hold max_ongoing_requests; a target above it could never be reached
    target = min(sc.up_queue, out["max_ongoing_requests"])
    return out | {"num_replicas": "auto", "autoscaling_config": {
        "min_replicas": sc.min_replicas, "initial_replicas": sc.min_replicas, "max_replicas": sc.max_replicas,
        "target_ongoing_requests": target, "upscale_delay_s": sc.up_s, "downscale_delay_s": sc.down_s}}


def ray_pool_factory(address: str | None, replicas: str, scale_up_p99_ms: float = 0.0):
    """`--engine ray`'s checks, run before anything starts (ray importable, --address answering, the flags
    the Ray engine does not take), then a ``make_pool(opts, metrics, say)`` for server.run_server; or
    ConfigError (exit 2)."""
    if serve is None:
        try:
            import ray.serve  # noqa: F401 (only for the reason it fails)
            e = "ray.serve did not import"
        except ImportError as err:
            e = err
        raise ConfigError(f"Ray Serve is not installed ({e})", field="--engine", value="ray",
                          fix="pip install 'tandem[ray]' (the `ray` extra: ray[serve,train]), or use --engine "
                              "local") from None
    if scale_up_p99_ms:   # Ray Serve's autoscaler scales on ongoing requests only
        raise ConfigError("p99 autoscaling is the local engine's", field="--scale-up-p99-ms",
                          value=scale_up_p99_ms, fix="leave it out with --engine ray (--replicas MIN:MAX scales "
                                                     "on ongoing requests there), or use --engine local")
    check_ray_address(address)

    def make_pool(opts, metrics, say=print):
        return RayPool(opts, metrics, say=say, address=address)
    return make_pool
