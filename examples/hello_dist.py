"""A user script for `tandem launch`: prints where each rank sits and checks an all_reduce.

    tandem launch --nproc-per-node 2 --simulate-nodes 2 examples/hello_dist.py
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group(os.environ.get("TANDEM_BACKEND", "gloo"))
    # destroyed on the way out, failures included: a process group left to the interpreter's exit can
    # abort it ("terminate called without an active exception", SIGABRT instead of the exception's exit 1)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        expect = world * (world - 1) / 2
        print(f"rank {rank}/{world} node {os.environ['GROUP_RANK']} local_rank {os.environ['LOCAL_RANK']} "
              f"all_reduce sum {t.item():.0f} (expect {expect:.0f})", flush=True)
        assert t.item() == expect
        if os.environ.get("HELLO_FAIL_RANK") == str(rank):
            raise RuntimeError(f"rank {rank} was told to fail")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
