"""Fixtures of the trainer's tests."""

import pytest

from tandem_testing import TINY, run_tandem


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """One small finished run (2 workers, 4 steps, checkpoints at 2 and 4: the last is its last step),
    shared read-only by the error and rerun tests; returns (spec path, run dir)."""
    tmp = tmp_path_factory.mktemp("finished")
    spec = tmp / "job.toml"
    spec.write_text(TINY.format(model="resnet18", remainder="pad", global_batch=32, micro_batch=8, max_steps=4,
                                dtype="fp32", every=2, keep=2, nproc=2, run_dir=str(tmp / "run")))
    r = run_tandem("train", str(spec))
    assert r.returncode == 0, r.stderr
    return spec, tmp / "run"
