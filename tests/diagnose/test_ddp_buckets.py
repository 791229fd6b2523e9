"""The gradient all-reduces diagnose counts in a trace are DDP's own buckets: one process (gloo, world
1: DDP's reducer all-reduces all the same), bucket_cap_mb 0.01 and 1000, the count and sizes read
from the trace against DDP's logging data (num_buckets_reduced, rebuilt_bucket_sizes)."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tandem.diagnose.analyze import ddp_buckets
from tandem.diagnose.trace import parse


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cap, buckets", [(0.01, 6), (1000, 1)])
def test_trace_all_reduces_are_ddp_buckets(group, tmp_path, cap, buckets):
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]), bucket_cap_mb=cap)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(8, 64)

    def step():
        with torch.profiler.record_function("tandem.backward"):  # as the trainer names it
            ddp(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # DDP rebuilds its buckets in the order of the first backward
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as p:
        with torch.profiler.record_function("ProfilerStep#3"):
            step()
    p.export_chrome_trace(str(tmp_path / "trace.json"))
    t = parse(json.loads((tmp_path / "trace.json").read_text()), 0, {"pid": os.getpid()})
    got = ddp_buckets(t, 3)
    log = ddp._get_ddp_logging_data()
    assert len(got) == log["num_buckets_reduced"] == buckets
    assert sorted(got) == sorted(int(b) for b in str(log["rebuilt_bucket_sizes"]).split(", "))
