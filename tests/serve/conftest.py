"""Exports to serve, shared by the session: a tied GPT and a ResNet-18, each checkpoint written in this
process and exported with the real `tandem export`."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.export_helpers import write_checkpoint
from serve.serve_helpers import export, write_resnet_checkpoint


@pytest.fixture(scope="session")
def gpt_export(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve-gpt")
    return export(write_checkpoint(root / "run"), root / "export")


@pytest.fixture(scope="session")
def resnet_export(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve-resnet")
    return export(write_resnet_checkpoint(root / "run"), root / "export")
