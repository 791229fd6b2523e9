"""Exports to serve, shared by the session: a tied GPT (vocab 16, and 256 for text) and a ResNet-18, each
checkpoint written in this process and exported with the real `tandem export`."""

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


@pytest.fixture(scope="session")
def text_gpt_export(tmp_path_factory) -> Path:
    """A GPT with the byte-level vocabulary of 256 (text prompts)."""
    root = tmp_path_factory.mktemp("serve-gpt256")
    return export(write_checkpoint(root / "run", model_overrides={"vocab": 256}), root / "export")


@pytest.fixture(scope="session")
def llama_export(tmp_path_factory) -> Path:
    """The same example as a Llama with grouped-query attention and its own rope_theta, its matrices scaled
    up so that greedy picks are far from ties."""
    def spread(sd):
        for v in sd.values():
            if v.dim() > 1:
                v.mul_(10)

    root = tmp_path_factory.mktemp("serve-llama")
    return export(write_checkpoint(root / "run", model_overrides={"name": "llama", "kv_heads": 2, "rope_theta": 500.0},
                                   mutate=spread), root / "export")
