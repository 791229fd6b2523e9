"""tandem's all_reduce busbw against a bare torch.distributed loop, measured in one run.

    python bench/comm_overhead.py [--nproc 2] [--sizes 256K,1M,4M,16M] [--iters 5] [--repeats 21]

Both sides run in the same worker processes (started by tandem's launcher), on the
same sizes, interleaved A/B, B/A, ... so machine noise hits both alike; each side's
busbw per size is from its median time over repeats, and the ratio per size is the
median of the paired (back-to-back) ratios tandem busbw / bare busbw. The headline
is their geometric mean over all sizes (target: at least 0.95).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from tandem.bench import comm_worker as cw
    from tandem.bench.collectives import COLLECTIVES, bus_factor
    from tandem.core.teardown import close_process_group

    device, backend = cw.resolve("auto", "auto")
    cw.init(device, backend)
    n = dist.get_world_size()
    world = cw.Link("world", dist.group.WORLD, list(range(n)))
    coll = COLLECTIVES["all_reduce"]
    rows = []
    for size in a.sizes:
        numel = size // 4
        bare_x = torch.ones(numel, device=device)
        tandem_t, bare_t, control_t = [], [], []
        # Enough calls per timed loop that one loop spans several scheduler slices (>= --min-loop-ms):
        # 5 calls of a 256 KiB all_reduce take ~5 ms, and one preemption then decides the ratio.
        # Every rank must run the same count, so the slowest rank's estimate decides.
        for _ in range(a.warmup):
            dist.all_reduce(bare_x)
        t0 = time.perf_counter()
        dist.all_reduce(bare_x)
        est = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(est, op=dist.ReduceOp.MAX)
        iters = max(a.iters, min(200, math.ceil(a.min_loop_ms / 1e3 / max(est.item(), 1e-6))))
        def run_tandem() -> None:
            # The bench's own path (buffers, warm-up, barrier, timed loop), in place like the bare loop.
            tandem_t.append(cw.time_once(coll, world, dist.get_rank(), numel, torch.float32, device,
                                         True, a.warmup, iters))

        def run_bare(into: list[float]) -> None:
            # What anyone would write by hand. The buffer is refilled (untimed) so that, like
            # tandem's fresh buffers, it never sums its way to inf over the repeats.
            bare_x.fill_(1.0)
            for _ in range(a.warmup):
                dist.all_reduce(bare_x)
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(bare_x)
            if device == "cuda":
                torch.cuda.synchronize()
            into.append((time.perf_counter() - t0) / iters)

        # A/A control: the bare loop against itself, in the same rotation. Its ratio is the noise
        # floor: a tandem/bare ratio inside the control's spread is no measurable overhead.
        sides = [run_tandem, lambda: run_bare(bare_t), lambda: run_bare(control_t)]
        orders = list(itertools.permutations(range(3)))
        for i in range(a.repeats):
            # Cycle through all six orders: each side goes first, and follows each other side,
            # equally often (a plain rotation would always run the control right after bare).
            for k in orders[i % len(orders)]:
                sides[k]()
        # Average over ranks as nccl-tests does, then the median over repeats.
        both = torch.tensor([tandem_t, bare_t, control_t], dtype=torch.float64)
        dist.all_reduce(both)
        both /= n
        t_tandem, t_bare = statistics.median(both[0].tolist()), statistics.median(both[1].tolist())
        f = bus_factor("all_reduce", n)
        # Each repeat's two loops ran back to back: their ratio sees the same machine load,
        # so the median of paired ratios is steadier than a ratio of medians on a busy host.
        ratios = sorted(b / t for t, b in zip(both[0].tolist(), both[1].tolist()))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        control = statistics.median(b / c for c, b in zip(both[2].tolist(), both[1].tolist()))
        rows.append({"size": size, "tandem_busbw_GBps": size / t_tandem * f / 1e9,
                     "bare_busbw_GBps": size / t_bare * f / 1e9, "ratio": statistics.median(ratios),
                     "ratio_q1": q[0], "ratio_q3": q[2], "control_ratio": control, "iters": iters})
    if dist.get_rank() == 0:
        ratio = math.exp(sum(math.log(r["ratio"]) for r in rows) / len(rows))
        control = math.exp(sum(math.log(r["control_ratio"]) for r in rows) / len(rows))
        cw.write_json(Path(a.out), {"world_size": n, "backend": backend, "device": device, "rows": rows,
                                    "ratio_geomean": ratio, "control_geomean": control, "min_iters": a.iters, "repeats": a.repeats})
    close_process_group()


def parent(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tandem.core.units import format_size
    from tandem.core.spec import LaunchSpec
    from tandem.launch.launcher import launch

    run_dir = Path(a.run_dir)
    out = run_dir / "comm_overhead.json"
    out.unlink(missing_ok=True)
    argv = [str(Path(__file__).resolve()), "--worker", "--out", str(out.resolve()), "--sizes",
            ",".join(map(str, a.sizes)), "--iters", str(a.iters), "--warmup", str(a.warmup),
            "--repeats", str(a.repeats), "--min-loop-ms", str(a.min_loop_ms)]
    launch(LaunchSpec(nproc_per_node=a.nproc), argv, run_dir, quiet=True)
    res = json.loads(out.read_text())
    t = Table(title=f"all_reduce busbw, {res['world_size']} ranks, {res['backend']} on {res['device']}, "
                    f"median of {res['repeats']} paired repeats", title_justify="left")
    for col in ("size", "iters", "tandem (GB/s)", "bare torch.distributed (GB/s)", "ratio (median)", "ratio IQR",
                "bare/bare"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(format_size(r["size"]), str(r["iters"]), f"{r['tandem_busbw_GBps']:.3f}", f"{r['bare_busbw_GBps']:.3f}",
                  f"{r['ratio']:.3f}", f"{r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}", f"{r['control_ratio']:.3f}")
    con = Console(width=120)
    con.print(t)
    verdict = "[green]meets[/]" if res["ratio_geomean"] >= 0.95 else "[red]below[/]"
    con.print(f"ratio (geometric mean) tandem/bare: {res['ratio_geomean']:.3f} ({verdict} the 0.95 target); "
              f"A/A control bare/bare: {res['control_geomean']:.3f} (the noise floor of this run)")
    return 0


def main() -> int:
    from tandem.core.units import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="256K,1M,4M,16M")
    # Many short paired repeats rather than few long ones: each pair sees the same moment of a
    # shared host's load, and the median over 21 pairs moves far less than over 11.
    p.add_argument("--iters", type=int, default=5, help="timed calls per loop, at least")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--min-loop-ms", type=float, default=30.0, help="more iterations for small sizes")
    p.add_argument("--run-dir", default="runs/bench-comm-overhead")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.sizes = [parse_size(s) for s in a.sizes.split(",")]
    if a.worker:
        worker(a)
        return 0
    return parent(a)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
    sys.exit(main())
