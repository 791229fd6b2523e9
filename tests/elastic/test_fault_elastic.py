"""Elastic nnodes 1:2 on two simulated nodes: one node dies, the other goes on at world 1."""

import json
import os
import signal

import pytest

from elastic.fault_helpers import finish, heartbeat, records, samples_seen, start_train, wait_for, write_spec
from tandem.train import checkpoint as ckpt


@pytest.mark.slow
def test_node_loss_continues_at_smaller_world_with_same_global_batch(reference, tmp_path):
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run", nproc=1, straggler_every=5)
    run = tmp_path / "run"
    proc = start_train(spec, "--launch.simulate_nodes", "2", "--launch.nnodes", "1:2", "--launch.max_restarts", "1",
                       env={"TANDEM_FAULTS": "slow:rank=1:ms=40"})  # rank 1 (on the node that dies) is slow
    hb = wait_for(lambda: (h := heartbeat(run, 1)) and h["step"] >= 14 and h, timeout=180,
                  what="rank 1 to reach step 14", interval=0.01)
    os.kill(hb["ppid"], signal.SIGKILL)  # the node: its torchrun agent...
    os.kill(hb["pid"], signal.SIGKILL)  # ...and its worker (own session, so not taken down with the agent)
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    assert "node(s) [" in err and "lost" in err
    result = json.loads(out)
    assert result["world"] == 1 and result["global_batch"] == 32 and result["grad_accum"] == 4
    starts = records(run, "start")
    assert [s["world"] for s in starts] == [2, 1] and [s["grad_accum"] for s in starts] == [2, 4]
    r = result["restarts"][0]
    assert r["resumed_step"] == 10 and r["lost_s"] < 60, r
    assert result["step"] == 45
    # the data position carried over: the same 32 samples at every step as the uninterrupted
    # run, so within the epoch nothing was skipped or seen twice after the change
    assert samples_seen(run) == reference["samples"]
    log = (run / "logs" / "rank-0.restart1.log").read_text()
    assert "world size changed 2 -> 1" in log and "320 samples of epoch 0 done" in log
    assert ckpt.read_meta(ckpt.latest(run / "checkpoints"))["world_size"] == 1
    # before the loss, the straggler report named the slow rank (2 batches x 40 ms per step)
    flagged = records(run, "straggler")
    assert flagged and {f["rank"] for f in flagged} == {1} and all(f["data_ms"] > 60 for f in flagged)
    assert [w["step"] for w in records(run, "ranks")][:2] == [5, 10]
    assert "straggler: rank 1 data wait" in (run / "logs" / "rank-0.log").read_text()
