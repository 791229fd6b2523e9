"""Checkpoint safety: kill during a save (sync and async), corrupt and truncated shards, manifests."""

import json
import shutil

import pytest

from elastic.fault_helpers import assert_bitwise_equal, final_state, finish, records, start_train, write_spec
from tandem.core.errors import CheckpointError
from tandem.train import checkpoint as ckpt
from tandem.train import manifest
from tandem_testing import run_tandem


def _copy_checkpoints(reference, dest):
    shutil.copytree(reference["run"] / "checkpoints", dest / "run" / "checkpoints")
    return dest / "run" / "checkpoints"


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
