"""Your own model, end to end: `tandem train`, `tandem export`, `tandem export verify` and a real
`tandem serve` on loopback, for README's table example (examples/own_data.toml: 30 float features) and
for a factory that reads int64 token ids (tests/serve/token_model.py, sized by [model] keys of its own).
The export's example input is a train sample's shape and dtype, recorded in the checkpoint's meta."""

from __future__ import annotations

import json

import pytest
import torch

import tandem.export
from serve.serve_helpers import Server
from tandem_testing import ROOT, run_tandem

TOKENS = """
name = "tokens-own"
[model]
name = "tests.serve.token_model:bag"
num_classes = 2
vocab = 16
width = 12
depth = 2
[data]
name = "tests.serve.token_model:datasets"
[optim]
lr = 0.1
ref_batch = 0
[schedule]
global_batch = 16
micro_batch = 16
epochs = 1
decay = "constant"
[launch]
nproc_per_node = 1
run_dir = "{run}"
"""


def _train_export_verify(args: list[str], run, out) -> dict:
    r = run_tandem("train", *args, "--launch.run_dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_tandem("export", str(run), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_tandem("export", "verify", str(out))
    assert r.returncode == 0 and r.stdout.startswith("ok:"), (r.stdout, r.stderr)
    return json.loads((out / "config.json").read_text())


def _serve_equals_load(out, run_dir, x: torch.Tensor) -> None:
    model = tandem.export.load(out)
    with torch.no_grad():
        want = model(x)
    with Server(out, run_dir) as srv:
        r = srv.client.post("/v1/predict", json={"inputs": x.tolist()})
        assert r.status_code == 200, r.text
        assert torch.tensor(r.json()["outputs"]).shape == want.shape
        assert torch.allclose(torch.tensor(r.json()["outputs"]), want, atol=1e-5)


@pytest.mark.slow
def test_own_data_example_exports_verifies_and_serves(tmp_path):
    pytest.importorskip("sklearn")
    cfg = _train_export_verify([str(ROOT / "examples" / "own_data.toml"), "--launch.nproc_per_node", "1",
                                "--schedule.epochs", "1"], tmp_path / "run", tmp_path / "export")
    assert cfg["example_input"] == {"shape": [1, 30], "dtype": "float32", "kind": "normal"}
    _serve_equals_load(tmp_path / "export", tmp_path / "serve", torch.randn(3, 30))


@pytest.mark.slow
def test_token_input_factory_exports_verifies_and_serves(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text(TOKENS.format(run=tmp_path / "run"))
    cfg = _train_export_verify([str(spec)], tmp_path / "run", tmp_path / "export")
    assert cfg["example_input"]["shape"] == [1, 6] and cfg["example_input"]["dtype"] == "int64"
    assert cfg["example_input"]["kind"] == "tokens" and 1 <= cfg["example_input"]["high"] <= 16
    # the factory got the [model] keys of its own (width, depth) and the field it names (vocab)
    assert cfg["factory"]["kwargs"] == {"num_classes": 2, "vocab": 16, "width": 12, "depth": 2}
    assert cfg["tensors"]["emb.weight"] == [16, 12] and "body.1.0.weight" in cfg["tensors"]
    _serve_equals_load(tmp_path / "export", tmp_path / "serve", torch.randint(0, 12, (4, 6)))
