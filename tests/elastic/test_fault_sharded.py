"""The key faults under FSDP2 (parallel.strategy zero2 / zero3): kill -9 at a random step resumes
bitwise; a lost node's survivors reload the sharded checkpoint resharded by DCP to the smaller world."""

import json
import random

import pytest

from elastic.fault_helpers import (assert_bitwise_equal, final_state, finish, kill_node_at_step, records,
                                   samples_seen, sigkill_at_step, start_train, write_spec)
from tandem.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow]
STEPS = 20  # 640 of the epoch's 1438 samples; checkpoints every 5 steps


@pytest.fixture(scope="module")
def zero3_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("zero3-reference")
    spec = write_spec(d / "job.toml", d / "run", max_steps=STEPS, every=5)
    rc, out, err = finish(start_train(spec, "--parallel.strategy", "zero3"))
    assert rc == 0, err[-3000:]
    result = json.loads(out)
    return {"run": d / "run", "result": result, "state": final_state(result["checkpoint"]),
            "samples": samples_seen(d / "run")}


def test_zero3_sigkill_at_random_step_resumes_bitwise(zero3_reference, tmp_path):
    kill_step, victim = random.Random(77).randint(6, 13), random.Random(78).randint(0, 1)
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run", max_steps=STEPS, every=5)
    proc = start_train(spec, "--parallel.strategy", "zero3", "--launch.max_restarts", "1")
    hb, result = sigkill_at_step(proc, tmp_path / "run", victim, kill_step)
    assert result["step"] == STEPS and result["parallel"] == zero3_reference["result"]["parallel"]
    (r,) = result["restarts"]
    # the newest checkpoint published at the kill (killed right after a multiple of 5: maybe still saving it)
    assert r["resumed_step"] in {(hb["step"] // 5) * 5, (hb["step"] - 1) // 5 * 5} and r["resumed_step"] >= 5
    assert_bitwise_equal(final_state(result["checkpoint"]), zero3_reference["state"])
    assert samples_seen(tmp_path / "run") == zero3_reference["samples"]


def test_zero2_node_loss_reshards_to_the_smaller_world(zero3_reference, tmp_path):
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run", nproc=1, max_steps=STEPS, every=5)
    run = tmp_path / "run"
    proc = start_train(spec, "--parallel.strategy", "zero2", "--launch.simulate_nodes", "2", "--launch.nnodes", "1:2",
                       "--launch.max_restarts", "1", env={"TANDEM_FAULTS": "slow:rank=1:ms=20"})
    kill_node_at_step(run, 1, 7)
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    result = json.loads(out)
    assert (result["world"], result["step"], result["global_batch"], result["grad_accum"]) == (1, STEPS, 32, 4)
    resumed = result["restarts"][0]["resumed_step"]
    assert resumed in (5, 10, 15)
    starts = records(run, "start")
    assert [s["world"] for s in starts] == [2, 1] and all("zero2" in s["parallel"] for s in starts)
    # the world-2 checkpoint (each rank wrote its FSDP shards) loaded into one rank, and training went on
    # with the same samples per step as the uninterrupted run
    assert samples_seen(run) == zero3_reference["samples"]
    log = (run / "logs" / "rank-0.restart1.log").read_text()
    assert f"resumed from {run / 'checkpoints' / f'step-{resumed:08d}'}" in log
    meta = ckpt.read_meta(ckpt.latest(run / "checkpoints"))
    assert meta.world_size == 1 and meta.parallel["strategy"] == "zero2"
    losses = [r["loss"] for r in records(run, "step")]
    assert all(x == x for x in losses) and losses[-1] < losses[0]  # finite, and it learned
