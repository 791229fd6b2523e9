"""The worker of `tandem bench comm`: one process per rank, started by the launcher.

    python -m tandem.bench.comm_worker --options OPTS.json --out RESULT.json

Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK),
measures every collective on every link class, and rank 0 writes RESULT.json
(schema ``tandem.bench.comm/1``) for the parent CLI to render.

Link classes: with one node, the whole world is the ``intra_node`` link. With
several nodes, ``intra_node`` is node 0's ranks, ``inter_node`` is local rank 0
of every node (one process per node, so only the network is between them), and
``world`` is everything. One representative group per class runs while the
other ranks wait at a barrier, so simulated nodes sharing one machine do not
steal each other's cores and the numbers are those of the link alone.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tandem.bench.collectives import COLLECTIVES, DTYPES, Collective, bus_factor, check, numel_for, tolerance
from tandem.bench.options import CommOptions, buffer_bytes_per_rank
from tandem.core.units import format_size
from tandem.core.environment import ClusterEnv, resolve_device
from tandem.core.errors import ConfigError
from tandem.core.teardown import close_process_group

SCHEMA = "tandem.bench.comm/1"


@dataclass
class Topology:
    rank: int
    world: int
    nnodes: int
    local_world: int
    node_of: list[int]     # node index (0..nnodes-1) of every global rank
    local_of: list[int]    # local rank of every global rank
    hosts: list[str]       # hostname of every node


@dataclass
class Link:
    name: str
    group: object          # ProcessGroup
    ranks: list[int]       # global ranks, group rank i == ranks[i]


def resolve(device: str, backend: str) -> tuple[str, str]:
    """The launcher exports its choice (TANDEM_DEVICE/TANDEM_BACKEND); honour it unless told otherwise."""
    return resolve_device(device, backend, os.environ, field="--device")


def init(device: str, backend: str, timeout_s: float | None = None) -> None:
    if device == "cuda":
        torch.cuda.set_device(ClusterEnv.detect().local_rank)
    if not dist.is_initialized():
        # Ranks outside the link being measured wait at a barrier for the whole sweep of that
        # link (minutes for 1 GiB messages on a slow network), so the default 10 min of a
        # collective timeout is too short; a crashed worker is caught by the launcher anyway.
        timeout = timeout_s or float(os.environ.get("TANDEM_PG_TIMEOUT", 3600))
        dist.init_process_group(backend, timeout=_dt.timedelta(seconds=timeout))


def topology() -> Topology:
    """Who is on which node, learned from the ranks themselves (GROUP_RANK from torchrun)."""
    env = ClusterEnv.detect()
    me = (env.node, env.local_rank, socket.gethostname())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    node_ids = sorted({g for g, _, _ in everyone})
    index = {g: i for i, g in enumerate(node_ids)}
    node_of = [index[g] for g, _, _ in everyone]
    hosts = [next(h for g, _, h in everyone if index[g] == i) for i in range(len(node_ids))]
    local_world = max(node_of.count(i) for i in range(len(node_ids)))
    return Topology(dist.get_rank(), len(everyone), len(node_ids), local_world,
                    node_of, [lr for _, lr, _ in everyone], hosts)


def build_links(topo: Topology) -> list[Link]:
    """Every rank calls new_group for every group, in the same order (torch requires it)."""
    if topo.nnodes == 1:  # one worker alone has no link to measure (one GPU: NCCL takes a rank per GPU)
        return [Link("intra_node", dist.group.WORLD, list(range(topo.world)))] if topo.world > 1 else []
    links = []
    node0 = [r for r in range(topo.world) if topo.node_of[r] == 0]
    if len(node0) > 1:
        links.append(Link("intra_node", dist.new_group(node0), node0))
    leaders = sorted((topo.node_of[r], r) for r in range(topo.world) if topo.local_of[r] == 0)
    leaders_r = [r for _, r in leaders]
    links.append(Link("inter_node", dist.new_group(leaders_r), leaders_r))
    if len(leaders_r) < topo.world:  # one rank per node: world is the inter-node group again
        links.append(Link("world", dist.group.WORLD, list(range(topo.world))))
    return links


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(coll: Collective, link: Link, grank: int, numel: int, dtype: torch.dtype, device: str,
              in_place: bool, warmup: int, iters: int) -> float:
    """Seconds per call on this rank (warm-up excluded), as nccl-tests times a loop of calls."""
    n = len(link.ranks)
    b = coll.buffers(numel, grank, n, dtype, device, in_place)
    for _ in range(warmup):
        coll.run(b, link.group, grank)
    _sync(device)
    dist.barrier(group=link.group)
    t0 = time.perf_counter()
    for _ in range(iters):
        coll.run(b, link.group, grank)
    _sync(device)
    return (time.perf_counter() - t0) / iters


def check_once(coll: Collective, link: Link, grank: int, numel: int, dtype: torch.dtype, device: str,
               in_place: bool) -> float:
    """Max error of one call on fresh buffers (timed loops reuse outputs, so they are not checked)."""
    b = coll.buffers(numel, grank, len(link.ranks), dtype, device, in_place)
    coll.run(b, link.group, grank)
    _sync(device)
    return check(b, grank)


def group_reduce(values: list[float], link: Link, device: str, op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=link.group)
    return t.tolist()


def measure_link(link: Link, opts: CommOptions, device: str) -> list[dict]:
    """Rows for one link (returned on the link's group rank 0; other members return [])."""
    grank = link.ranks.index(dist.get_rank())
    n = len(link.ranks)
    dtype = DTYPES[opts.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for name in opts.collectives:
        coll = COLLECTIVES[name]
        modes = [m for m in (["out", "in"] if opts.mode == "both" else [opts.mode])
                 if m == "out" or coll.in_place]
        if not modes:  # in-place only asked, collective has none: measure out-of-place
            modes = ["out"]
        for size in opts.sizes():
            numel = numel_for(coll, size, elem, n)
            if numel == 0:
                continue  # below one element per rank; nccl-tests skips these too
            for mode in modes:
                t = time_once(coll, link, grank, numel, dtype, device, mode == "in", opts.warmup, opts.iters)
                err = check_once(coll, link, grank, numel, dtype, device, mode == "in") if opts.check else 0.0
                t_sum, err_max = group_reduce([t, 0.0], link, device, dist.ReduceOp.SUM)[0], \
                    group_reduce([err], link, device, dist.ReduceOp.MAX)[0]
                if grank != 0:
                    continue
                t_avg = t_sum / n  # nccl-tests' default: time averaged over ranks
                nbytes = numel * elem
                algbw = nbytes / t_avg
                rows.append({
                    "link": link.name, "group_size": n, "collective": name, "size": nbytes,
                    "count": numel, "dtype": opts.dtype, "mode": mode, "time_us": t_avg * 1e6,
                    "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * bus_factor(name, n) / 1e9,
                    "max_err": err_max, "checked": opts.check,
                    "ok": err_max <= tolerance(dtype, n),
                })
    return rows


def measure_compute(device: str, budget_s: float = 0.3) -> dict[str, float]:
    """Achieved matmul FLOP/s per dtype on this one worker: what a kernel gets, not the peak."""
    out = {}
    side = 2048 if device == "cuda" else 512
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(side, side, device=device).to(dtype)
        b = torch.randn(side, side, device=device).to(dtype)
        a @ b  # first call pays library set-up
        _sync(device)
        n, t0 = 0, time.perf_counter()
        while True:
            a @ b
            n += 1
            _sync(device)
            if time.perf_counter() - t0 > budget_s / 2 or n >= 1000:
                break
        out[key] = 2.0 * side ** 3 * n / (time.perf_counter() - t0)
    return out


def _check_device_memory(opts: CommOptions, device: str) -> None:
    if device != "cuda":
        return
    free, _ = torch.cuda.mem_get_info()
    if buffer_bytes_per_rank(opts) > free:
        raise ConfigError(f"sizes up to {format_size(opts.max_bytes)} do not fit in "
                          f"{free / 2**30:.1f} GiB free GPU memory", field="--max-bytes",
                          value=format_size(opts.max_bytes), fix="lower --max-bytes")


def device_info(device: str) -> dict:
    """What the calibration was measured on, so `tandem plan` can plan that cluster (or refuse another)."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"device_name": props.name, "device_memory_bytes": props.total_memory}
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: memory unknown to the planner
        ram = None
    return {"device_name": "cpu", "device_memory_bytes": ram, "cores": os.cpu_count()}


def run(opts: CommOptions) -> dict | None:
    """Measure everything; returns the result on global rank 0, None elsewhere."""
    device, backend = resolve(opts.device, opts.backend)
    _check_device_memory(opts, device)
    init(device, backend)
    topo = topology()
    links = build_links(topo)
    rows: list[dict] = []
    for link in links:
        dist.barrier()
        if topo.rank in link.ranks:
            rows += measure_link(link, opts, device)
    compute = measure_compute(device) if opts.compute and topo.rank == 0 else {}
    dist.barrier()
    if topo.rank != 0:
        return None
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": topo.hosts[0], "hosts": topo.hosts, "backend": backend, "device": device,
        "world_size": topo.world, "nnodes": topo.nnodes, "local_world_size": topo.local_world,
        "torch": torch.__version__, "options": opts.to_dict(), "rows": rows, **device_info(device),
        "compute": {"achieved_flops": compute} if compute else {},
    }


def write_json(path: Path, data: dict) -> None:
    """Write then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def worker_main(argv: list[str] | None, prog: str, load: Callable[[dict], Any], run_fn: Callable[[Any], Any],
                payload: Callable[[Any, Any], dict]) -> int:
    """A worker module's main (bench comm, doctor): read the options file, run, rank 0 writes the result."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--options", required=True, help="JSON file of the verb's options")
    p.add_argument("--out", required=True, help="where rank 0 writes the result JSON")
    a = p.parse_args(argv)
    opts = load(json.loads(Path(a.options).read_text()))
    ok = False
    try:
        result = run_fn(opts)
        if result is not None:  # ranks other than 0 return None
            write_json(Path(a.out), payload(opts, result))
        ok = True
    finally:
        close_process_group(ok)  # on success after a barrier (tandem/core/teardown.py)
    return 0


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, "python -m tandem.bench.comm_worker",
                       lambda d: CommOptions.from_dict(d).validate(), run, lambda opts, result: result)


if __name__ == "__main__":
    sys.exit(main())
