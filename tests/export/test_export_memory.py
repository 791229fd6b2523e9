"""Peak memory of `tandem export` on a 1 GiB checkpoint: within the import baseline + 2 x the largest
tensor + 64 MiB, measured from the kernel (wait4) on fresh processes (bench/export_memory.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tandem_testing import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("export_memory", ROOT / "bench" / "export_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_streamed_export_of_1gib_stays_within_the_bound(tmp_path):
    b = _bench()
    r = b.measure(b.prepare(tmp_path, size_gib=1.0, tensor_mib=64), whole_load=False)  # the ratio: the bench
    mib = 1 << 20
    print(f"\nbaseline {r['baseline_peak_bytes'] / mib:.0f} MiB, streamed {r['streamed_peak_bytes'] / mib:.0f} MiB "
          f"(bound {r['bound_bytes'] / mib:.0f})")
    assert r["checkpoint_bytes"] >= 1 << 30
    assert r["within_bound"], json.dumps({k: v for k, v in r.items() if k != "export_summary"})
    config = json.loads((tmp_path / "out-big" / "config.json").read_text())   # a user's factory, recorded
    assert config["factory"] == {"name": "tandem_bench_big:build", "kwargs": {"num_classes": 10, "in_channels": 3}}
