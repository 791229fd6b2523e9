"""Checkpoint safety: kill during a save (sync and async), corrupt and truncated shards, manifests."""

import json
import shutil

import pytest

from elastic.fault_helpers import assert_bitwise_equal, final_state, finish, records, start_train, write_spec
from tandem.core.errors import CheckpointError
from tandem.train import checkpoint as ckpt
from tandem.train import manifest
from tandem.train.checkpoint_meta import CheckpointMeta
from tandem_testing import run_tandem


def _copy_checkpoints(reference, dest):
    shutil.copytree(reference["run"] / "checkpoints", dest / "run" / "checkpoints")
    return dest / "run" / "checkpoints"


@pytest.mark.slow
def test_manifest_names_truncated_and_altered_files(reference, tmp_path):
    ck = _copy_checkpoints(reference, tmp_path)
    good = ck / "step-00000040"
    assert manifest.problem(good) is None
    shard = good / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed
    shard.write_bytes(bytes(data))
    assert "__1_0.distcp is altered: sha256 differs" in manifest.problem(good)
    shard.write_bytes(bytes(data[:100]))
    assert "__1_0.distcp is truncated or altered: 100 bytes" in manifest.problem(good)
    with pytest.raises(CheckpointError, match="failed its sha256 manifest"):
        ckpt.read_meta(good)
    assert ckpt.latest(ck).name == "step-00000045"  # the newest is fine
    (ck / "step-00000045" / "__0_0.distcp").unlink()
    assert ckpt.latest(ck).name == "step-00000030"  # 45 missing a shard, 40 altered: back to 30


@pytest.mark.slow
def test_explicit_resume_of_truncated_checkpoint_is_refused(reference, tmp_path):
    ck = _copy_checkpoints(reference, tmp_path)
    shard = ck / "step-00000040" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run2")
    r = run_tandem("train", str(spec), "--checkpoint.resume", str(ck / "step-00000040"))
    assert r.returncode == 2
    msg = " ".join(r.stderr.split())
    assert "checkpoint.resume: checkpoint step-00000040 failed its sha256 manifest: __0_0.distcp is truncated" in msg
    assert "Fix: resume from an earlier checkpoint" in msg


@pytest.mark.slow
def test_altered_newest_shard_falls_back_and_ends_bitwise(reference, tmp_path):
    ck = _copy_checkpoints(reference, tmp_path)
    shard = ck / "step-00000045" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-50] ^= 0x01
    shard.write_bytes(bytes(data))
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run")
    rc, out, err = finish(start_train(spec))
    assert rc == 0, err[-3000:]
    result = json.loads(out)
    refused = records(tmp_path / "run", "ckpt_refused")
    assert refused and "step-00000045" in refused[0]["path"] and refused[0]["used"].endswith("step-00000040")
    assert "checkpoint step-00000045 refused" in (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert manifest.problem(ck / "step-00000045") is None  # re-saved from the redone steps
    assert_bitwise_equal(final_state(result["checkpoint"]), reference["state"])


def _pending(tmp_path, step, fut, keep_last=2):
    """A PendingSave of a world of one whose DCP future the test completes by hand."""
    import torch

    from tandem.train.runtime import DistContext

    ctx = DistContext(rank=0, world=1, local_rank=0, local_world=1, node=0, device=torch.device("cpu"),
                      backend="gloo")
    ck = tmp_path / "checkpoints"
    tmp = ck / f".tmp-step-{step:08d}"
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"meta")
    (tmp / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    meta = CheckpointMeta(step=step, epoch=0, world_size=1, model="x")
    return ck, ckpt.PendingSave(fut, ck, step, tmp, ck / f"step-{step:08d}", ctx, meta, keep_last)


def test_background_publish_moves_latest_only_after_write_and_hash(tmp_path):
    from concurrent.futures import Future

    fut = Future()
    ck, p = _pending(tmp_path, 10, fut)
    (ck / "latest").write_text("step-00000005\n")
    assert p.poll() is None and not p.done()  # the write is in flight: poll returns at once
    assert (ck / "latest").read_text() == "step-00000005\n" and not (ck / "step-00000010").exists()
    fut.set_result(None)
    assert p.wait() == ck / "step-00000010"
    assert (ck / "latest").read_text() == "step-00000010\n" and not (ck / ".tmp-step-00000010").exists()
    assert manifest.problem(ck / "step-00000010") is None
    assert set(json.loads((ck / "step-00000010" / "manifest.json").read_text())["files"]) == {
        ".metadata", "__0_0.distcp", "meta.json"}
    assert p.written_at <= p.published_at and p.poll() == ck / "step-00000010"


def test_failed_background_write_is_not_published(tmp_path):
    from concurrent.futures import Future

    fut = Future()
    ck, p = _pending(tmp_path, 20, fut)
    fut.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(CheckpointError, match=r"async save of step-00000020 failed \(RuntimeError: Connection closed"
                                              r".*'latest' still names the previous checkpoint") as e:
        p.wait()
    assert e.value.field == "checkpoint.dir" and "free space" in e.value.fix
    assert not (ck / "latest").exists() and not (ck / "step-00000020").exists()
    assert ckpt.clean_partial(ck) == [".tmp-step-00000020"]


@pytest.mark.slow
def test_sigkill_during_background_publish_resumes_from_previous(reference, tmp_path):
    """Rank 0 dies in its publish thread with step 30 written and hashed but not renamed: the
    restart uses step 20, removes the partial folder and ends bitwise equal to the reference."""
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run")
    rc, out, err = finish(start_train(spec, "--launch.max_restarts", "1", "--checkpoint.async_save", "true",
                                      env={"TANDEM_FAULTS": "sigkill:rank=0:publish=30"}))
    assert rc == 0, err[-3000:]
    run = tmp_path / "run"
    # fired in the background thread: the training thread never ran the publish
    assert ("fault injection: sigkill on rank 0 at publish 30 (thread tandem-publish-30)"
            in (run / "logs" / "rank-0.log").read_text())
    result = json.loads(out)
    (restart,) = result["restarts"]
    assert restart["resumed_step"] == 20, restart
    assert records(run, "ckpt_cleaned")[0]["folders"] == [".tmp-step-00000030"]
    assert [p.name for p in ckpt.list_complete(run / "checkpoints")] == [
        "step-00000030", "step-00000040", "step-00000045"]
    saves = records(run, "ckpt")
    assert saves and all(s["mode"] == "async" and s["stage_s"] <= s["block_s"] <= s["save_s"] for s in saves)
    assert all(s["publish_s"] > 0 and s["written_s"] <= s["save_s"] for s in saves)
    assert_bitwise_equal(final_state(result["checkpoint"]), reference["state"])
    print("\nasync saves: " + ", ".join(f"step {s['step']} blocked {s['block_s'] * 1e3:.0f} ms (staging "
                                        f"{s['stage_s'] * 1e3:.0f}, wait {s['wait_s'] * 1e3:.0f}) of "
                                        f"{s['save_s'] * 1e3:.0f} ms" for s in saves))
