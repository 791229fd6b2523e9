"""tandem's all_reduce busbw against a bare torch.distributed loop, measured in one run.

    python bench/comm_overhead.py [--nproc 2] [--sizes 256K,1M,4M,16M] [--iters 20] [--repeats 5]

Both sides run in the same worker processes (started by tandem's launcher), on the
same sizes, interleaved A/B, B/A, ... so machine noise hits both alike; each side's
busbw per size is from its median time over repeats, and the ratio per size is the
median of the paired (back-to-back) ratios tandem busbw / bare busbw. The headline
is their geometric mean over all sizes (target: at least 0.95).
"""

from __future__ import annotations

import argparse
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

    device, backend = cw.resolve("auto", "auto")
    cw.init(device, backend)
    n = dist.get_world_size()
    world = cw.Link("world", dist.group.WORLD, list(range(n)))
    coll = COLLECTIVES["all_reduce"]
    rows = []
    for size in a.sizes:
        numel = size // 4
        bare_x = torch.ones(numel, device=device)
        tandem_t, bare_t = [], []
        def run_tandem() -> None:
            # The bench's own path (buffers, warm-up, barrier, timed loop), in place like the bare loop.
            tandem_t.append(cw.time_once(coll, world, dist.get_rank(), numel, torch.float32, device,
                                         True, a.warmup, a.iters))

        def run_bare() -> None:
            # What anyone would write by hand.
            for _ in range(a.warmup):
                dist.all_reduce(bare_x)
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                dist.all_reduce(bare_x)
            if device == "cuda":
                torch.cuda.synchronize()
            bare_t.append((time.perf_counter() - t0) / a.iters)

        for i in range(a.repeats):
            # Alternate which side goes first so neither always follows the other's warm caches.
            for fn in ((run_tandem, run_bare) if i % 2 == 0 else (run_bare, run_tandem)):
                fn()
        # Average over ranks as nccl-tests does, then the median over repeats.
        both = torch.tensor([tandem_t, bare_t], dtype=torch.float64)
        dist.all_reduce(both)
        both /= n
        t_tandem, t_bare = statistics.median(both[0].tolist()), statistics.median(both[1].tolist())
        f = bus_factor("all_reduce", n)
        # Each repeat's two loops ran back to back: their ratio sees the same machine load,
        # so the median of paired ratios is steadier than a ratio of medians on a busy host.
        paired = statistics.median(b / t for t, b in zip(both[0].tolist(), both[1].tolist()))
        rows.append({"size": size, "tandem_busbw_GBps": size / t_tandem * f / 1e9,
                     "bare_busbw_GBps": size / t_bare * f / 1e9, "ratio": paired})
    if dist.get_rank() == 0:
        ratio = math.exp(sum(math.log(r["ratio"]) for r in rows) / len(rows))
        cw.write_json(Path(a.out), {"world_size": n, "backend": backend, "device": device, "rows": rows,
                                    "ratio_geomean": ratio, "iters": a.iters, "repeats": a.repeats})
    dist.destroy_process_group()


def parent(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tandem.bench.options import format_size
    from tandem.core.spec import LaunchSpec
    from tandem.launch.launcher import launch

    run_dir = Path(a.run_dir)
    out = run_dir / "comm_overhead.json"
    out.unlink(missing_ok=True)
    argv = [str(Path(__file__).resolve()), "--worker", "--out", str(out.resolve()), "--sizes",
            ",".join(map(str, a.sizes)), "--iters", str(a.iters), "--warmup", str(a.warmup),
            "--repeats", str(a.repeats)]
    launch(LaunchSpec(nproc_per_node=a.nproc), argv, run_dir, quiet=True)
    res = json.loads(out.read_text())
    t = Table(title=f"all_reduce busbw, {res['world_size']} ranks, {res['backend']} on {res['device']}, "
                    f"median of {res['repeats']} paired repeats x {res['iters']} iters", title_justify="left")
    for col in ("size", "tandem (GB/s)", "bare torch.distributed (GB/s)", "ratio"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(format_size(r["size"]), f"{r['tandem_busbw_GBps']:.3f}", f"{r['bare_busbw_GBps']:.3f}",
                  f"{r['ratio']:.3f}")
    con = Console(width=120)
    con.print(t)
    verdict = "[green]meets[/]" if res["ratio_geomean"] >= 0.95 else "[red]below[/]"
    con.print(f"ratio (geometric mean) tandem/bare: {res['ratio_geomean']:.3f} ({verdict} the 0.95 target)")
    return 0


def main() -> int:
    from tandem.bench.options import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="256K,1M,4M,16M")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=11)
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
