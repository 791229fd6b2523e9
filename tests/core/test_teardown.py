"""close_process_group with two real gloo ranks: on success they meet first; a failure path does not
wait for a peer; a peer that never comes costs the timeout and a warning, not a hang."""

from __future__ import annotations

import io
import json
import time
from contextlib import redirect_stderr
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.core.teardown import close_process_group


def _wait_for(path: Path, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _ranks(rank: int, tmp: str) -> None:
    tmp_path, seen = Path(tmp), {}

    def join(name: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=rank, world_size=2)
        t = torch.ones(4)
        dist.all_reduce(t)

    def close(key: str, ok: bool, timeout_s: float) -> None:
        err = io.StringIO()
        with redirect_stderr(err):
            close_process_group(ok, timeout_s)
        seen[key] = err.getvalue()

    join("success")  # both succeed: they meet in the barrier, nothing is said
    close("success", True, 120)

    join("failure")  # rank 0 failed; rank 1 is alive but closes only once rank 0 has: a barrier would hang
    if rank == 0:
        close("failure", False, 3600)
        (tmp_path / "failure-closed").touch()
    else:
        _wait_for(tmp_path / "failure-closed")
        close_process_group(False)

    join("late")  # rank 0 succeeded, rank 1 never comes to the barrier: rank 0 waits 1 s, warns, closes
    if rank == 0:
        close("late", True, 1)
        (tmp_path / "late-closed").touch()
    else:
        _wait_for(tmp_path / "late-closed")
        close_process_group(False)

    if rank == 0:
        (tmp_path / "seen.json").write_text(json.dumps({**seen, "initialized": dist.is_initialized()}))


def test_close_waits_for_peers_only_on_success(tmp_path):
    mp.spawn(_ranks, args=(str(tmp_path),), nprocs=2, join=True)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["success"] == "" and seen["failure"] == "" and not seen["initialized"]
    assert seen["late"].startswith("warning: rank 0: the ranks did not meet before closing the process group "
                                   "within 1 s (") and seen["late"].rstrip().endswith("closing it anyway")
