"""Fixtures shared by the tests (helpers live in tandem_testing.py)."""

import os
from pathlib import Path

import pytest

from tandem_testing import TINY


@pytest.fixture
def tiny_spec(tmp_path):
    """Write a small digits job spec; returns its path. Keyword arguments fill the template."""

    def make(name: str = "job.toml", **kw) -> Path:
        vals = dict(model="resnet18", remainder="pad", global_batch=32, micro_batch=8, max_steps=6, dtype="fp32",
                    every=3, keep=2, nproc=2, run_dir=str(tmp_path / "run"))
        vals.update(kw)
        p = tmp_path / name
        p.write_text(TINY.format(**vals))
        return p

    return make


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory):
    """One data cache for the session (inherited by every worker process), not the user's."""
    os.environ["TANDEM_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    os.environ.pop("TANDEM_CACHE_DIR", None)
