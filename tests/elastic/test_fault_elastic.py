"""Elastic nnodes 1:2 on two simulated nodes: one node dies, the other goes on at world 1."""

import json
import math

import pytest

from elastic.fault_helpers import finish, kill_node_at_step, records, samples_seen, start_train, write_spec
from tandem.train import checkpoint as ckpt


@pytest.mark.slow
def test_node_loss_continues_at_smaller_world_with_same_global_batch(reference, tmp_path):
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run", nproc=1, straggler_every=5)
    run = tmp_path / "run"
    proc = start_train(spec, "--launch.simulate_nodes", "2", "--launch.nnodes", "1:2", "--launch.max_restarts", "1",
                       env={"TANDEM_FAULTS": "slow:rank=1:ms=40"})  # rank 1 (on the node that dies) is slow
    kill_node_at_step(run, 1, 14)
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
    assert ckpt.read_meta(ckpt.latest(run / "checkpoints")).world_size == 1
    # before the loss, the straggler report named the slow rank (2 batches x 40 ms per step)
    flagged = records(run, "straggler")
    assert flagged and {f["rank"] for f in flagged} == {1} and all(f["data_ms"] > 60 for f in flagged)
    assert [w["step"] for w in records(run, "ranks")][:2] == [5, 10]
    assert "straggler: rank 1 data wait" in (run / "logs" / "rank-0.log").read_text()


def _cosine(pos, total=45, warmup=2):  # the configured LR curve (warm-up 2, cosine over 45 steps), written out
    return (pos + 1) / warmup if pos < warmup else 0.5 * (1 + math.cos(math.pi * (pos - warmup) / (total - warmup)))


@pytest.mark.slow
def test_node_loss_with_scale_lr_halves_the_batch_and_the_lr(reference, tmp_path):
    """on_resize = scale_lr: micro 8 x accum 2 stay, so world 2 -> 1 halves the global batch (32 -> 16)
    and the LR (linear scaling rule); the schedule continues from the resumed step at half pace."""
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run", nproc=1)
    run = tmp_path / "run"
    proc = start_train(spec, "--launch.simulate_nodes", "2", "--launch.nnodes", "1:2", "--launch.max_restarts", "1",
                       "--elastic.on_resize", "scale_lr", env={"TANDEM_FAULTS": "slow:rank=1:ms=20"})
    kill_node_at_step(run, 1, 12)
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    result = json.loads(out)
    resumed = result["restarts"][0]["resumed_step"]
    assert resumed in (10, 20)  # the newest checkpoint before the kill (10 unless the machine was very slow)
    left = math.ceil((1438 - 32 * resumed) / 16)  # the rest of the epoch at 16 samples per step
    assert (result["world"], result["global_batch"], result["grad_accum"]) == (1, 16, 2)
    assert result["step"] == resumed + left and result["effective_lr"] == pytest.approx(0.025)
    starts = records(run, "start")
    assert [(s["world"], s["global_batch"], s["grad_accum"], s["on_resize"]) for s in starts] == [
        (2, 32, 2, "scale_lr"), (1, 16, 2, "scale_lr")]
    assert [s["effective_lr"] for s in starts] == pytest.approx([0.05, 0.025])
    rz = records(run, "resize")
    assert len(rz) == 1 and rz[0]["step"] == resumed and rz[0]["total_steps"] == resumed + left
    assert (rz[0]["old_global_batch"], rz[0]["new_global_batch"], rz[0]["lr_scale"]) == (32, 16, 0.5)
    assert (rz[0]["peak_lr_before"], rz[0]["peak_lr_after"]) == pytest.approx((0.05, 0.025))
    # the logged LR: as the uninterrupted run up to the resize, then half the configured curve at half pace
    lr = {r["step"]: r["lr"] for r in records(run, "step")}  # a redone step's last record wins
    ref_lr = {r["step"]: r["lr"] for r in records(reference["run"], "step")}
    assert [lr[k] for k in range(1, resumed + 1)] == [ref_lr[k] for k in range(1, resumed + 1)]
    after = range(resumed + 1, resumed + left + 1)
    assert [lr[k] for k in after] == pytest.approx(
        [0.05 * 0.5 * _cosine(resumed + (k - 1 - resumed) * 0.5) for k in after], rel=1e-9)
    # samples: the same as the uninterrupted run up to the resize; after it, two half steps hold exactly
    # the samples of one reference step (world 1 takes the epoch's positions in order)
    seen, ref = samples_seen(run), reference["samples"]
    assert all(seen[k] == ref[k] for k in range(1, resumed + 1))
    assert all(len(seen[k]) == 16 for k in list(after)[:-1]) and len(seen[resumed + left]) == 14
    for i, k in enumerate(range(resumed + 1, resumed + left + 1, 2)):
        assert sorted(seen[k] + seen.get(k + 1, [])) == ref[resumed + 1 + i]
    every = [i for idx in seen.values() for i in idx]
    assert len(every) == len(set(every)) == 1438  # one epoch: every sample exactly once
    log = (run / "logs" / "rank-0.restart1.log").read_text()
    assert ("on_resize = scale_lr: micro 8 x accum 2 kept, global batch 32 -> 16; LR x 16/32 (linear scaling "
            "rule): peak 0.05 -> 0.025") in log
    print(f"\nscale_lr: resumed at step {resumed}, {left} steps at batch 16; lr after resize "
          f"{lr[resumed + 1]:.5f} (uninterrupted run: {ref_lr[resumed + 1]:.5f})")
