"""`tandem export` on checkpoints written in this process: exact tensors, tied weights stored once and
tied again, deterministic bytes, casts, tp slices, sharded files, and bad input refused cleanly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from export.export_helpers import cli, latest_checkpoint, reference_state, write_checkpoint
from tandem.export import load, verify
from tandem.export.exporter import ExportOptions, export


def _export(run: Path, out: Path, **kw) -> dict:
    return export(ExportOptions(run, out, progress=False, **kw))


def _stored(out: Path) -> dict[str, torch.Tensor]:
    got = {}
    for f in sorted(out.glob("model*.safetensors")):
        got.update(load_file(f))
    return got


def test_export_holds_the_checkpoint_tensors_once_and_reloads_tied(gpt_run, tmp_path):
    r = _export(gpt_run, tmp_path / "out")
    ref = reference_state(latest_checkpoint(gpt_run), tmp_path)
    got = _stored(tmp_path / "out")
    assert r["tied"] == {"head.weight": "tok_emb.weight"}
    assert set(got) == set(ref) - {"head.weight"}            # the tied copy is stored once
    for k, v in got.items():
        assert torch.equal(v, ref[k]), k
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert man["tied"] == {"head.weight": "tok_emb.weight"} and man["version"] == 1
    assert man["provenance"]["step"] == 5 and man["provenance"]["layout"]["strategy"] == "ddp"
    model = load(tmp_path / "out")
    assert not model.training and model.head.weight is model.tok_emb.weight
    from tandem.core.config import from_dict
    from tandem.models import build_model
    spec = from_dict(json.loads((gpt_run / "spec.json").read_text()))
    trained = build_model(spec.model).eval()
    trained.load_state_dict(ref)
    x = torch.randint(0, spec.model.vocab, (3, spec.model.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), trained(x))             # bitwise, fp32
    assert verify(tmp_path / "out")["tensors"] == len(got)


def test_second_export_is_byte_identical(gpt_run, tmp_path):
    _export(gpt_run, tmp_path / "a", tp=2)
    _export(gpt_run, tmp_path / "b", tp=2)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_bf16_records_the_measured_cast_error(gpt_run, tmp_path):
    r = _export(gpt_run, tmp_path / "out", dtype="bf16")
    ref = reference_state(latest_checkpoint(gpt_run), tmp_path)
    got = _stored(tmp_path / "out")
    measured = max((got[k].double() - ref[k].double()).abs().max().item() for k in got)
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert measured > 0 and r["max_cast_error"] == measured == man["dtype"]["max_cast_error"]
    for k, t in man["tensors"].items():
        assert t["max_cast_error"] == (got[k].double() - ref[k].double()).abs().max().item(), k
    assert load(tmp_path / "out").tok_emb.weight.dtype == torch.bfloat16


def test_tp_slices_concatenate_to_the_full_tensors(gpt_run, tmp_path):
    _export(gpt_run, tmp_path / "out", tp=2)
    full = _stored(tmp_path / "out")
    ranks = [load_file(tmp_path / "out" / f"tp-{r}-of-2" / "model.safetensors") for r in range(2)]
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    dims = man["tp"]["ranks"][0]["tensors"]
    split = {k for k, t in dims.items() if t["dim"] is not None}
    assert {"layers.0.attn.wq.weight", "layers.0.attn.wo.weight", "tok_emb.weight", "layers.1.mlp.w1.bias"} <= split
    assert dims["layers.0.attn.wo.weight"]["dim"] == 1 and dims["layers.0.attn.wo.bias"]["dim"] is None
    for k, v in full.items():
        d = dims[k]["dim"]
        if d is None:
            assert all(torch.equal(r[k], v) for r in ranks), k
        else:
            assert ranks[0][k].shape[d] == v.shape[d] // 2, k
            assert torch.equal(torch.cat([r[k] for r in ranks], dim=d), v), k
    m1 = load(tmp_path / "out", tp_rank=1)
    assert torch.equal(m1.layers["0"].attn.wq.weight, ranks[1]["layers.0.attn.wq.weight"])
    assert m1.head.weight is m1.tok_emb.weight


def test_shards_and_index_above_the_shard_size(gpt_run, tmp_path):
    r = _export(gpt_run, tmp_path / "out", shard_size=100_000)
    shards = sorted((tmp_path / "out").glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "out" / "model.safetensors").exists()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_stored(tmp_path / "out")) and r["tensors"] == len(index["weight_map"])
    ref = reference_state(latest_checkpoint(gpt_run), tmp_path)
    model = load(tmp_path / "out")
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def _corrupt(run: Path) -> None:
    shard = next(latest_checkpoint(run).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _untie(sd):
    sd["head.weight"] = sd["head.weight"].clone() + 1.0


@pytest.mark.parametrize("case,args,needle", [
    ("not a checkpoint", [], "not a checkpoint"),
    ("corrupt shard", [], "failed its sha256 manifest: __0_0.distcp is altered"),
    ("unknown dtype", ["--dtype", "int4"], "--dtype: unknown dtype (got 'int4')"),
    ("out exists", [], "--out: the output folder exists"),
    ("tp 3", ["--tp", "3"], "heads 4 is not divisible by tp 3 (4 % 3 = 1)"),
    ("tied differ", [], "the model ties head.weight to tok_emb.weight but the checkpoint holds different values"),
    ("memory", ["--max-memory", "1K"], "--max-memory: the largest tensor takes"),
    ("fp16 overflow", ["--dtype", "fp16"], "--dtype: tok_emb.weight does not fit in fp16"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, gpt_run, case, args, needle):
    run, out = tmp_path / "run", tmp_path / "out"
    if case == "not a checkpoint":
        run.mkdir()
    elif case == "tied differ":
        write_checkpoint(run, mutate=_untie)
    elif case == "fp16 overflow":
        write_checkpoint(run, mutate=lambda sd: sd["tok_emb.weight"].view(-1)[0].fill_(1e6))
    else:
        shutil.copytree(gpt_run, run)
    if case == "corrupt shard":
        _corrupt(run)
    if case == "out exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    out = out / "nested" if case == "fp16 overflow" else out   # a parent it creates is removed again
    code, stdout, err = cli(["export", str(run), "--out", str(out), *args], capsys)
    assert code == 2, (stdout, err)
    assert err.startswith("error: ") and needle in err and "Fix: " in err, err
    assert len(err.strip().splitlines()) == 1, err
    if case == "out exists":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists() and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-export")]


def test_force_replaces_and_verify_catches_an_altered_file(gpt_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    code, stdout, err = cli(["export", str(gpt_run), "--out", str(out), "--force"], capsys)
    assert code == 0, err
    assert "exported step 5" in stdout and not (out / "old.txt").exists()
    code, stdout, err = cli(["export", "verify", str(out)], capsys)
    assert code == 0 and stdout.startswith("ok: "), err
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-3] ^= 0x01
    (out / "model.safetensors").write_bytes(bytes(data))
    code, stdout, err = cli(["export", "verify", str(out)], capsys)
    assert code == 2 and "model.safetensors is altered" in err, err


def _train_bn(sd):
    sd["bn.running_mean"].uniform_(-1, 1)
    sd["bn.running_var"].uniform_(0.5, 2)
    sd["bn.num_batches_tracked"].fill_(7)


def test_a_users_own_model_exports_with_its_factory(tmp_path):
    run = write_checkpoint(tmp_path / "run", {"name": "export.custom_model:build"}, mutate=_train_bn)
    r = _export(run, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["factory"] == {"name": "export.custom_model:build", "kwargs": {"num_classes": 10, "in_channels": 3}}
    ref = reference_state(latest_checkpoint(run), tmp_path)
    got = _stored(tmp_path / "out")
    assert set(got) == set(ref) and got["bn.num_batches_tracked"].dtype == torch.int64
    assert all(torch.equal(got[k], ref[k]) for k in got) and r["dtype"] == "keep"
    model = load(tmp_path / "out")
    from export.custom_model import build
    ref_model = build().eval()
    ref_model.load_state_dict(ref)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(x), ref_model(x))
    assert float(model.scale) == 0.5                  # the non-persistent buffer, from a real build
    assert verify(tmp_path / "out")["output_shape"] == [1, 10]


def test_export_refuses_what_verify_would_refuse_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """A model that cannot read the recorded example input: `tandem export` says so in one line, exit 2,
    and publishes no folder (before, it reported success and `export verify` failed on its folder)."""
    from tandem.export import format as fmt

    run = write_checkpoint(tmp_path / "run", {"name": "export.custom_model:build"}, mutate=_train_bn)
    real = fmt.example_input
    monkeypatch.setattr(fmt, "example_input", lambda spec, rec=None: {**real(spec, rec), "shape": [1, 30]})
    code, out, err = cli(["export", str(run), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the model's forward failed on the example input [1, 30]" in err and "nothing was written" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-export*"))


def test_example_input_is_the_recorded_sample():
    from tandem.export import format as fmt
    from tandem.train.checkpoint_meta import input_record

    spec = {"model": {"name": "m:f", "in_channels": 3}, "data": {"image_size": 8}}
    assert fmt.example_input(spec) == {"shape": [1, 3, 8, 8], "dtype": "float32", "kind": "normal"}  # older runs
    table = input_record(torch.zeros(30))
    assert fmt.example_input(spec, table) == {"shape": [1, 30], "dtype": "float32", "kind": "normal"}
    ids = input_record(torch.tensor([3, 9, 1]))
    assert ids == {"shape": [1, 3], "dtype": "int64", "high": 10}
    x = fmt.make_input(fmt.example_input(spec, ids))
    assert x.dtype == torch.int64 and x.shape == (1, 3) and 0 <= int(x.min()) and int(x.max()) < 10
    gpt = {"model": {"name": "gpt", "seq": 16, "vocab": 32}}
    assert fmt.example_input(gpt, ids) == {"shape": [1, 16], "dtype": "int64", "kind": "tokens", "high": 32}


def test_incomplete_checkpoint_and_full_disk(gpt_run, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(gpt_run, run)
    ck = latest_checkpoint(run)
    (ck / ".metadata").unlink()
    code, _, err = cli(["export", str(ck), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "incomplete checkpoint (missing .metadata)" in err, err
    import errno

    from tandem.export import stfile

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(stfile.StreamFile, "_put", full)
    code, _, err = cli(["export", str(gpt_run), "--out", str(tmp_path / "out")], capsys)
    assert code == 1 and "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-export*"))


@pytest.mark.slow
def test_tp_slices_are_what_tandems_training_tp_plan_holds(gpt_run, tmp_path):
    from harness.numerics import spawn

    from export.tp_worker import check_slices
    _export(gpt_run, tmp_path / "out", tp=2)
    for rank in spawn(check_slices, 2, str(tmp_path / "out")):
        assert rank["names"] and rank["mismatched"] == [], rank
        assert "layers.0.attn.wo.weight" in rank["sharded"] and "tok_emb.weight" in rank["sharded"]
        assert rank["max_diff"] < 1e-5, rank                   # tp forward = full forward (sum order differs)
