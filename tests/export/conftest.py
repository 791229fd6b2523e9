"""Checkpoints to export, shared by the session: one written in this process (fast, for the unit tests)
and real `tandem train` runs (one per layout, started on first use)."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.export_helpers import LAYOUTS, write_checkpoint
from tandem_testing import run_tandem


@pytest.fixture(scope="session")
def gpt_run(tmp_path_factory) -> Path:
    """A tied GPT (grouped-query attention) checkpoint written in-process."""
    return write_checkpoint(tmp_path_factory.mktemp("gpt") / "run")


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """layout -> run dir of a real 2-rank `tandem train` run (2 steps), started on first use."""
    cache: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in cache:
            run = tmp_path_factory.mktemp(layout) / "run"
            if layout == "resnet":
                spec = tmp_path_factory.mktemp("resnet-spec") / "job.toml"
                from tandem_testing import TINY
                spec.write_text(TINY.format(model="resnet18", remainder="pad", global_batch=16, micro_batch=8,
                                            max_steps=2, dtype="fp32", every=0, keep=1, nproc=2,
                                            run_dir=str(run)))
                args = [str(spec)]
            else:
                args = [*LAYOUTS[layout], "--launch.run_dir", str(run)]
            r = run_tandem("train", *args, "--json")
            assert r.returncode == 0, r.stderr[-3000:]
            cache[layout] = run
        return cache[layout]
    return get
