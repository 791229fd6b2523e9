"""The worker of `tandem doctor`: node checks on every node, cross-node checks, quick all_reduce.

    python -m tandem.diagnose.doctor_worker --options OPTS.json --out RESULT.json

Local rank 0 of every node runs the node-local checks (its own /dev/shm, disk,
interfaces, route to the master); the node leaders then compare versions,
measure clock skew and test shared storage; every rank joins one all_reduce.
Rank 0 gathers it all and writes RESULT.json ({"checks": [...]}).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from tandem.diagnose.options import DoctorOptions
import torch
import torch.distributed as dist

from tandem.bench import comm_worker as cw
from tandem.bench.collectives import COLLECTIVES, bus_factor
from tandem.core.environment import ClusterEnv
from tandem.diagnose import network, system
from tandem.diagnose.checks import FAIL, INFO, PASS, WARN, Check

SKEW_WARN_S = 0.1
# torch's c10d rendezvous compares heartbeat timestamps written by other nodes with
# its own clock; skew near its keep-alive window makes live nodes look dead.
SKEW_FAIL_S = 30.0


def _node_name(topo: cw.Topology, node: int) -> str:
    return f"{node}:{topo.hosts[node]}"


def node_local(opts: DoctorOptions, device: str) -> list[Check]:
    cenv = ClusterEnv.detect()
    master = cenv.master_addr or "127.0.0.1", cenv.master_port
    # Under the launcher the master's store is up, so a refused connection is a real failure.
    ifaces = network.interfaces()
    r = network.rdma()
    env = os.environ
    return [*system.node_checks(device, opts.nproc_per_node, opts.checkpoint_path),
            network.check_interfaces(ifaces), network.check_rdma(r),
            network.check_ifname_var("NCCL_SOCKET_IFNAME", env.get("NCCL_SOCKET_IFNAME"), ifaces),
            network.check_ifname_var("GLOO_SOCKET_IFNAME", env.get("GLOO_SOCKET_IFNAME"), ifaces),
            network.check_ib_hca(env.get("NCCL_IB_HCA"), r),
            *network.check_master(master[0], master[1], ifaces, expect_listener=True)]


def compare_versions(per_node: dict[str, dict[str, str]]) -> Check:
    keys = sorted({k for v in per_node.values() for k in v})
    diff = [k for k in keys if len({v.get(k) for v in per_node.values()}) > 1]
    if not diff:
        return Check("versions match", PASS, f"identical on {len(per_node)} node(s)")
    detail = "; ".join(f"{k}: " + ", ".join(f"{n}={v.get(k)}" for n, v in per_node.items()) for k in diff)
    return Check("versions match", FAIL, detail,
                 fix="install the same torch/CUDA/NCCL/driver on every node (one container image)")


def clock_offsets(leaders: cw.Link, rounds: int = 5) -> tuple[list[float], float]:
    """Offset of each leader's clock from rank 0's, and the uncertainty (half the best round trip).

    Rank 0 reads its clock before a barrier (t0) and after an all_reduce (t3); leader
    i reads its clock between the two, so in true time t0 <= t_i <= t3 and
    t_i - (t0 + t3) / 2 is its offset to within (t3 - t0) / 2.
    """
    me = leaders.ranks.index(dist.get_rank())
    best = None
    for _ in range(rounds):
        t0 = time.time()
        dist.barrier(group=leaders.group)
        stamps = torch.zeros(len(leaders.ranks), dtype=torch.float64)
        if me != 0:
            stamps[me] = time.time()
        dist.all_reduce(stamps, group=leaders.group)
        t3 = time.time()
        if best is None or t3 - t0 < best[1] - best[0]:
            best = (t0, t3, stamps)
    t0, t3, stamps = best
    mid = (t0 + t3) / 2
    return [0.0] + [float(s) - mid for s in stamps[1:]], (t3 - t0) / 2


def check_skew(offsets: list[float], unc: float, names: list[str]) -> Check:
    worst_i = max(range(len(offsets)), key=lambda i: abs(offsets[i]))
    skew = abs(offsets[worst_i])
    detail = f"max {skew * 1e3:.1f} ms ({names[worst_i]}), +/- {unc * 1e3:.1f} ms"
    fix = "synchronise clocks on every node (chrony/NTP: `chronyc tracking`, `timedatectl`)"
    if skew - unc > SKEW_FAIL_S:
        return Check("clock skew", FAIL, detail, fix=fix)
    if skew - unc > SKEW_WARN_S:
        return Check("clock skew", WARN, detail, fix=fix)
    return Check("clock skew", PASS, detail)


def shared_storage(leaders: cw.Link, path: Path, names: list[str], simulated: bool) -> Check | None:
    """Rank 0 writes a token file; every other node must see the same bytes."""
    me = leaders.ranks.index(dist.get_rank())
    token = [f".tandem-doctor-{uuid.uuid4().hex}" if me == 0 else None]
    dist.broadcast_object_list(token, group_src=0, group=leaders.group)
    f = path / token[0]
    err = ""
    if me == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            f.write_text(token[0])
        except OSError as e:
            err = f"cannot write {f}: {e.strerror}"
    dist.barrier(group=leaders.group)
    seen = "ok"
    if me != 0:
        try:
            seen = "ok" if f.read_text() == token[0] else "different content"
        except OSError:
            seen = "missing"
    states: list = [None] * len(leaders.ranks)
    dist.all_gather_object(states, seen, group=leaders.group)
    dist.barrier(group=leaders.group)
    if me != 0:
        return None
    f.unlink(missing_ok=True)
    if err:
        return Check("shared storage", FAIL, err, fix="make the path writable, or pass --shared-path")
    bad = [f"{names[i]} ({s})" for i, s in enumerate(states) if s != "ok"]
    if bad:
        return Check("shared storage", FAIL, f"{path} written on {names[0]} is not visible on {', '.join(bad)}",
                     fix="mount the same shared filesystem (NFS/Lustre/...) at this path on every node, "
                         "or pass --shared-path to one that is")
    note = " (simulated nodes share this machine's disk)" if simulated else ""
    return Check("shared storage", PASS, f"{path} visible on all {len(states)} nodes{note}")


def quick_all_reduce(opts: DoctorOptions, device: str, world: cw.Link) -> Check | None:
    coll = COLLECTIVES["all_reduce"]
    n = len(world.ranks)
    numel = max(1, opts.busbw_bytes // 4)
    grank = dist.get_rank()
    t = cw.time_once(coll, world, grank, numel, torch.float32, device, True, 2, 5)
    err = cw.check_once(coll, world, grank, numel, torch.float32, device, False)
    t_avg = cw.group_reduce([t], world, device, dist.ReduceOp.SUM)[0] / n
    err = cw.group_reduce([err], world, device, dist.ReduceOp.MAX)[0]
    if grank != 0:
        return None
    busbw = numel * 4 / t_avg * bus_factor("all_reduce", n) / 1e9
    return judge_busbw(busbw, numel * 4, n, err, opts.expect_busbw_GBps)


def judge_busbw(busbw: float, nbytes: int, n: int, err: float, expected: float) -> Check:
    """Wrong is a failure; under half the expected busbw a warning; without an expectation, a number."""
    detail = f"{busbw:.3f} GB/s busbw at {nbytes / 2**20:g} MiB over {n} ranks"
    if err > 0:
        return Check("all_reduce", FAIL, detail + f": WRONG result (max error {err:g})",
                     fix="a transport corrupts data: rerun with NCCL_DEBUG=INFO, check `tandem doctor --nccl-log`")
    if n == 1:
        return Check("all_reduce", INFO, "one rank: nothing to measure")
    if expected > 0:
        detail += f", expected {expected:g}"
        if busbw < 0.5 * expected:
            return Check("all_reduce", WARN, detail + " (under half)",
                         fix="check the transport with NCCL_DEBUG=INFO (`tandem doctor --nccl-log`), "
                             "NCCL_SOCKET_IFNAME/NCCL_IB_HCA, and run `tandem bench comm` for the full curve")
        return Check("all_reduce", PASS, detail)
    return Check("all_reduce", INFO, detail + " (give --expect-busbw or --calibration to judge it)")


def collapse(checks: list[Check], nnodes: int) -> list[Check]:
    """One row (node "all") for a check that reads the same on every node; per-node rows otherwise.

    64 nodes x a dozen identical rows would bury the one node that differs.
    """
    if nnodes < 2:
        return checks
    groups: dict[str, list[Check]] = {}
    for c in checks:
        groups.setdefault(c.name, []).append(c)
    out = []
    for name, rows in groups.items():
        same = len(rows) == nnodes and len({(c.status, c.detail, c.fix) for c in rows}) == 1
        out += [Check(name, rows[0].status, rows[0].detail, rows[0].fix, node="all")] if same else rows
    return out


def run(opts: DoctorOptions) -> list[Check] | None:
    device, backend = cw.resolve(opts.device, "auto")
    # A node that stops answering after the rendezvous must become a failure, not an hour's hang.
    cw.init(device, backend, timeout_s=opts.collective_timeout_s)
    topo = cw.topology()
    names = [_node_name(topo, i) for i in range(topo.nnodes)]
    leader_ranks = [min(r for r in range(topo.world) if topo.node_of[r] == i) for i in range(topo.nnodes)]
    # Object exchanges and the clock use a CPU group even when the job's backend is NCCL.
    cpu = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    leaders = cw.Link("leaders", dist.new_group(leader_ranks, backend="gloo"), leader_ranks)
    is_leader = topo.rank in leader_ranks
    mine = node_local(opts, device) if is_leader else []
    node = names[topo.node_of[topo.rank]]
    for c in mine:
        c.node = node
    payload = ({"checks": [c.to_dict() for c in mine], "versions": system.versions()} if is_leader else None)
    gathered: list = [None] * topo.world
    dist.all_gather_object(gathered, payload, group=cpu)
    cross: list[Check] = []
    if topo.nnodes > 1 and is_leader:
        offsets, unc = clock_offsets(leaders)
        if topo.rank == 0:
            cross.append(check_skew(offsets, unc, names))
        simulated = len(set(topo.hosts)) == 1
        c = shared_storage(leaders, Path(opts.shared_path or opts.checkpoint_path), names, simulated)
        cross += [c] if c else []
    ar = quick_all_reduce(opts, device, cw.Link("world", dist.group.WORLD, list(range(topo.world))))
    if topo.rank != 0:
        return None
    checks = collapse([Check.from_dict(d) for p in gathered if p for d in p["checks"]], topo.nnodes)
    if topo.nnodes > 1:
        cross.insert(0, compare_versions({names[topo.node_of[r]]: gathered[r]["versions"] for r in leader_ranks}))
    for c in cross + ([ar] if ar else []):
        c.node = "all"
        checks.append(c)
    return checks


def main(argv: list[str] | None = None) -> int:
    return cw.worker_main(argv, "python -m tandem.diagnose.doctor_worker", lambda d: DoctorOptions(**d), run,
                          lambda opts, checks: {"schema": "tandem.doctor/1", "options": asdict(opts),
                                                "checks": [c.to_dict() for c in checks]})


if __name__ == "__main__":
    sys.exit(main())
