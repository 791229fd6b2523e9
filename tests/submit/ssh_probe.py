"""Worker of test_ssh_submit: an all_reduce across the hosts, and which variables reached it.

    ssh_probe.py            one all_reduce, then exit
    ssh_probe.py DIR        touch DIR/ready-<rank> after it, then all_reduce until a peer is gone
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
env = {k: os.environ.get(k) for k in ("TANDEM_PROBE_ALLOWED", "PROBE_KEPT", "PROBE_OUTSIDE")}
print(f"rank {rank}/{world} node {os.environ['GROUP_RANK']} local {os.environ['LOCAL_RANK']}/"
      f"{os.environ['LOCAL_WORLD_SIZE']} sum {t.item():.0f} env {env}", flush=True)
if len(sys.argv) > 1:
    (Path(sys.argv[1]) / f"ready-{rank}").touch()
    while True:  # the job's own pace; it ends when a peer's death breaks the collective
        dist.all_reduce(t)
        time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
