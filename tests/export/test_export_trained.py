"""`tandem export` on checkpoints of real 2-rank `tandem train` runs, one per layout: every exported
tensor equals the checkpoint's, the loaded model's outputs equal the trained weights' bitwise (fp32),
and a second export is byte-identical."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from export.export_helpers import latest_checkpoint, reference_state
from tandem.export import load, verify
from tandem.export.exporter import ExportOptions, export
from tandem_testing import run_tandem


def _inputs(spec) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    m = spec.model
    if m.name == "gpt":
        return torch.randint(0, m.vocab, (4, m.seq), generator=g)
    return torch.randn(4, m.in_channels, spec.data.image_size, spec.data.image_size, generator=g)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "zero3", "tp2", "pp2", "dp2xtp2-zero2", "resnet"])
def test_export_of_a_trained_checkpoint_is_exact(trained, tmp_path, layout):
    run = trained(layout)
    ckpt = latest_checkpoint(run)
    r = export(ExportOptions(run, tmp_path / "a", progress=False))
    ref = reference_state(ckpt, tmp_path)
    got = load_file(tmp_path / "a" / "model.safetensors")
    for k, v in got.items():
        assert torch.equal(v, ref[k]), k
    assert set(got) | set(r["tied"]) == set(ref)
    assert (r["tied"] == {"head.weight": "tok_emb.weight"}) == (layout not in ("pp2", "resnet"))
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    prov = man["provenance"]
    assert prov["world_size"] == (4 if layout.startswith("dp2") else 2) and prov["step"] == 2
    assert prov["layout"]["tp"] == (2 if "tp2" in layout else 1)
    if layout == "resnet":   # BatchNorm statistics and the integer counters are exported as they were
        assert got["bn1.num_batches_tracked"].dtype == torch.int64 and int(got["bn1.num_batches_tracked"]) == 2

    from tandem.core.config import from_dict
    from tandem.models import build_model
    spec = from_dict(json.loads((run / "spec.json").read_text()))
    trained_model = build_model(spec.model).eval()
    trained_model.load_state_dict(ref)
    model = load(tmp_path / "a")
    x = _inputs(spec)
    with torch.no_grad():
        assert torch.equal(model(x), trained_model(x))       # bitwise in fp32
    verify(tmp_path / "a")

    export(ExportOptions(run, tmp_path / "b", progress=False))
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


@pytest.mark.slow
def test_cli_export_and_verify_of_a_zero3_run(trained, tmp_path):
    run = trained("zero3")
    r = run_tandem("export", str(run), "--dtype", "bf16", "--tp", "2", "--json", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["out"] == str(run / "export" / "step-00000002") and out["max_cast_error"] > 0
    assert "tp-1-of-2/model.safetensors" in json.loads((run / "export" / "step-00000002" / "manifest.json")
                                                      .read_text())["files"]
    v = run_tandem("export", "verify", out["out"], timeout=120)
    assert v.returncode == 0 and v.stdout.startswith("ok: "), v.stderr[-2000:]
