"""`tandem train` with the Llama example (examples/llama_reverse.toml): it learns under a model-parallel
layout, and a Llama shape the layout cannot split is refused before any process starts."""

from __future__ import annotations

import json

import pytest

from tandem_testing import ROOT, run_tandem

SPEC = ROOT / "examples" / "llama_reverse.toml"


@pytest.mark.slow
def test_llama_learns_to_reverse_under_tp2_with_sequence_parallel(tmp_path):
    r = run_tandem("train", str(SPEC), "--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                   "--launch.run_dir", str(tmp_path / "run"), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["parallel"] == "ddp: pp 1 x dp 1 x tp 2 = 2 ranks"
    # token accuracy on held-out strings, chance 0.1 (measured 0.873; the GPT, with learned absolute
    # positions, reaches 1.0: rotary positions are relative, and reversing asks for absolute ones)
    assert out["accuracy"] >= 0.7, out


def test_kv_heads_tp_cannot_split_fails_before_launch(tmp_path):
    r = run_tandem("train", str(SPEC), "--parallel.tp", "2", "--model.kv_heads", "1",
                   "--launch.run_dir", str(tmp_path / "run"), timeout=60)
    assert r.returncode != 0
    assert "model.kv_heads" in r.stderr and "kv_heads 1 is not divisible by tp 2 (1 % 2 = 1)" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "logs").exists()   # no worker was started
