"""Bad input gets one clear message, a non-zero exit, and no checkpoint is touched."""

import os
import shutil

import pytest

from tandem_testing import run_tandem, snapshot

pytestmark = [pytest.mark.slow]  # one training run shared by the module (tests/train/conftest.py)


@pytest.fixture(scope="module")
def trained(finished_run):
    """A small finished run with two checkpoints (read-only): the spec and its checkpoint folder."""
    spec, run = finished_run
    return spec, run / "checkpoints"


def expect_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    text = " ".join(r.stderr.split())
    assert text.startswith("error:"), text
    for w in words:
        assert w in text, (w, text)


def test_unknown_key(trained):
    spec, ck = trained
    before = snapshot(ck)
    expect_error(run_tandem("train", str(spec), "--optim.learning_rate", "1"), "optim.learning_rate: unknown key")
    assert snapshot(ck) == before


def test_impossible_batch(trained):
    spec, ck = trained
    expect_error(run_tandem("train", str(spec), "--schedule.global_batch", "1000", "--launch.nproc_per_node", "4",
                            "--schedule.micro_batch", "256"),
                 "global_batch 1000 is not divisible by 4 workers x micro_batch 256", "Fix:")


def test_missing_data_path(trained):
    spec, _ = trained
    expect_error(run_tandem("train", str(spec), "--data.name", "npz", "--data.path", "/no/such/data.npz"),
                 "data.path: data file not found", "/no/such/data.npz")


def test_resume_other_model_refused_and_kept(trained):
    spec, ck = trained
    before = snapshot(ck)
    expect_error(run_tandem("train", str(spec), "--model.width", "8"),  # resume=auto finds the width-4 one
                 "checkpoint is of another model or shape", "in the checkpoint but")
    assert snapshot(ck) == before


def test_incomplete_checkpoint_refused(trained, tmp_path):
    spec, ck = trained
    broken = tmp_path / "step-00000002"
    shutil.copytree(ck / "step-00000002", broken)
    os.remove(broken / ".metadata")
    before = snapshot(ck)
    expect_error(run_tandem("train", str(spec), "--checkpoint.resume", str(broken)),
                 "incomplete checkpoint (missing .metadata)")
    assert snapshot(ck) == before and broken.is_dir()


def test_auto_resume_skips_incomplete(trained):
    from tandem.train.checkpoint import latest

    _, ck = trained
    assert latest(ck).name == "step-00000004"


def test_missing_config_file(tmp_path):
    expect_error(run_tandem("train", str(tmp_path / "nope.toml")), "config: no such file")
