"""Bench comm with real gloo processes on loopback: every collective checked, a broken one caught,
and the whole CLI through tandem's launcher with simulated nodes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.bench import comm_worker
from tandem.bench.collectives import COLLECTIVES, Collective
from tandem.bench.options import CommOptions


def _worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ.update(GROUP_RANK="0", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        topo = comm_worker.topology()
        (link,) = comm_worker.build_links(topo)
        opts = CommOptions(collectives=["all"], min_bytes=8, max_bytes=512, factor=64, warmup=1, iters=2).validate()
        rows = comm_worker.measure_link(link, opts, "cpu")
        # A transport that silently drops data: all_reduce that only takes the max.
        broken = Collective("all_reduce", True, False, COLLECTIVES["all_reduce"].buffers,
                            lambda b, g, r: dist.all_reduce(b.out, op=dist.ReduceOp.MAX, group=g))
        COLLECTIVES["all_reduce"] = broken
        bad = comm_worker.measure_link(link, CommOptions(min_bytes=64, max_bytes=64, warmup=0, iters=1), "cpu")
        if rank == 0:
            Path(out).write_text(json.dumps({"rows": rows, "bad": bad, "link": link.name}))
    finally:
        dist.destroy_process_group()


def test_every_collective_checked_and_a_broken_one_caught(tmp_path):
    out = tmp_path / "rows.json"
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert res["link"] == "intra_node"
    assert {r["collective"] for r in rows} == set(COLLECTIVES)
    assert all(r["ok"] and r["max_err"] == 0.0 and r["time_us"] > 0 for r in rows)
    ar = [r for r in rows if r["collective"] == "all_reduce"]
    assert {r["mode"] for r in ar} == {"out", "in"} and {r["size"] for r in ar} == {8, 512}
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2) for r in ar)
    assert {r["mode"] for r in rows if r["collective"] == "all_to_all"} == {"out"}
    assert res["bad"] and not any(r["ok"] for r in res["bad"])
    assert all(r["max_err"] > 0 for r in res["bad"])


@pytest.mark.slow
def test_cli_through_launcher_with_simulated_nodes(tmp_path):
    """2 simulated nodes x 2 workers: intra-node, inter-node and world are measured apart."""
    from tandem.cli.bench import comm_cmd

    comm_cmd(collectives="all_reduce,all_gather", min_bytes="64", max_bytes="16K", factor=16, dtype="fp32",
             warmup=1, iters=2, mode="out", no_check=False, no_compute=False, nproc_per_node=2, nnodes="1",
             node_rank=0, master_addr="127.0.0.1", master_port=29500, rdzv_endpoint="", simulate_nodes=2,
             timeout=60, device="cpu", backend="auto", run_dir=tmp_path / "run", json_out=tmp_path / "r.json",
             csv_out=tmp_path / "r.csv", plot=tmp_path / "r.png", calibration=tmp_path / "cal.json")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["world_size"] == 4 and res["nnodes"] == 2 and res["local_world_size"] == 2
    sizes = {(r["link"], r["group_size"]) for r in res["rows"]}
    assert sizes == {("intra_node", 2), ("inter_node", 2), ("world", 4)}
    assert all(r["ok"] for r in res["rows"])
    cal = json.loads((tmp_path / "cal.json").read_text())
    assert cal["schema"] == "tandem.calibration/1" and cal["world_size"] == 4 and cal["nnodes"] == 2
    assert set(cal["links"]) == {"intra_node", "inter_node"}
    for link in cal["links"].values():
        assert link["bandwidth_Bps"] > 0 and link["latency_s"] >= 0
        assert set(link["collectives"]) == {"all_reduce", "all_gather"}
    assert cal["compute"]["achieved_flops"]["fp32"] > 0
    assert (tmp_path / "r.png").stat().st_size > 0 and (tmp_path / "r.csv").read_text().count("\n") == 1 + 18  # 3 links x 2 collectives x 3 sizes
