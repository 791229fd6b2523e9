"""Shared fixtures of the bench tests."""

from __future__ import annotations

import pytest

from tandem.bench.collectives import bus_factor
from tandem.bench.options import CommOptions


def _result(wrong: bool = False) -> dict:
    rows = []
    for link, n in (("intra_node", 2), ("inter_node", 2)):
        for coll in ("all_reduce", "all_gather"):
            for size in (1024, 1 << 20):
                for mode in ("out", "in"):
                    t = 1e-4 + size / 2e9
                    rows.append({"link": link, "group_size": n, "collective": coll, "size": size,
                                 "count": size // 4, "dtype": "fp32", "mode": mode, "time_us": t * 1e6,
                                 "algbw_GBps": size / t / 1e9, "busbw_GBps": size / t / 1e9 * bus_factor(coll, n),
                                 "max_err": 0.0, "checked": True, "ok": True})
    if wrong:
        rows[0].update(ok=False, max_err=3.0)
    return {"schema": "tandem.bench.comm/1", "host": "h", "backend": "gloo", "device": "cpu", "world_size": 4,
            "nnodes": 2, "options": CommOptions().to_dict(), "rows": rows,
            "compute": {"achieved_flops": {"fp32": 1e11, "bf16": 2e9}}}



@pytest.fixture
def fake_result():
    """A bench comm result with exact alpha = 100 us and 2 GB/s on two links (wrong=True spoils one row)."""
    return _result
