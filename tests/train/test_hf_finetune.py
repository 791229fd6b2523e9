"""A Hugging Face causal LM fine-tuned as a user's own factory: from_pretrained on a local folder saved here,
its own tokenizer's tokens (prepare-text --tokenizer), loss = "model" under 2-rank ddp, then tandem export
(which cannot build such a factory on the meta device) and export verify (a token input of the tokenizer's
range, the model's output object read for its logits). The model's loss trains as the built-in one does."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from tandem.core.errors import ConfigError  # noqa: E402
from tandem.export import format as fmt  # noqa: E402
from tandem_testing import ROOT, run_tandem  # noqa: E402
from train.hf_lm import corpus_files, make_tokenizer, tiny_llama  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}  # the workers import train.hf_lm

SPEC = """
name = "hf-finetune"
[model]
name = "train.hf_lm:from_folder"
path = "{base}"
loss = "model"
[data]
name = "tokens"
path = "{data}"
num_samples = 16
[optim]
name = "adamw"
lr = 0.0001
weight_decay = 0.0
ref_batch = 0
[schedule]
global_batch = 8
micro_batch = 4
max_steps = 3
log_every = 1
[launch]
nproc_per_node = 2
run_dir = "{run}"
"""


def step_losses(run):
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "step"]


def save_base(folder, vocab, seq=16):
    torch.manual_seed(1)
    model = tiny_llama(vocab=vocab, hidden=32, layers=1, heads=4, seq=seq)
    model.save_pretrained(str(folder))
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_export_builds_a_from_pretrained_factory_for_real(tmp_path):
    save_base(tmp_path / "base", vocab=40)
    model = fmt.build_meta({"name": "train.hf_lm:from_folder", "extra": {"path": str(tmp_path / "base")}})
    assert not any(p.is_meta for p in model.parameters())  # from_pretrained refuses the meta device
    with pytest.raises(ConfigError, match="factory 'train.hf_lm:from_folder' raised"):
        fmt.build_meta({"name": "train.hf_lm:from_folder", "extra": {"path": str(tmp_path / "nowhere")}})


@pytest.mark.slow
def test_finetune_a_saved_transformers_model_then_export_and_verify(tmp_path):
    base, data, run, out = tmp_path / "base", tmp_path / "tok", tmp_path / "run", tmp_path / "export"
    tok = make_tokenizer(base)
    before = save_base(base, vocab=tok.get_vocab_size())
    r = run_tandem("data", "prepare-text", str(corpus_files(tmp_path / "src")), "--out", str(data),
                   "--tokenizer", str(base), "--held-out", "0.25")
    assert r.returncode == 0, r.stderr
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(base=base, data=data, run=run))
    r = run_tandem("train", str(spec), "--json", env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = step_losses(run)
    # the saved model's (random) weights, not a fresh init: about ln(vocab) nats a token
    assert len(losses) == 3 and all(abs(v - torch.log(torch.tensor(320.0)).item()) < 0.5 for v in losses), losses
    # the model's own loss is tandem's next-token loss: the same run with the built-in cross-entropy on the
    # output's logits takes the same steps (a loss scaled or shifted by one position would not)
    ce = tmp_path / "run-ce"
    r = run_tandem("train", str(spec), "--model.loss", "cross_entropy", "--launch.run_dir", str(ce), "--json",
                   env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert step_losses(ce) == pytest.approx(losses, rel=1e-5, abs=1e-6)

    r = run_tandem("export", str(run), "--out", str(out), env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["example_input"] == {"shape": [1, 16], "dtype": "int64", "kind": "tokens", "high": 320}
    assert cfg["factory"] == {"name": "train.hf_lm:from_folder", "kwargs": {"path": str(base)}}
    r = run_tandem("export", "verify", str(out), env=ENV, timeout=600)
    assert r.returncode == 0 and "its forward gives [1, 16, 320]" in r.stdout, r.stdout + r.stderr

    from safetensors.torch import load_file
    after = load_file(str(out / "model.safetensors"))
    assert after.keys() == before.keys()
    # started from the saved weights (a fresh init would differ by ~0.02), and trained: 3 Adam steps of 1e-4
    for n, w in before.items():
        d = (after[n] - w).abs().max().item()
        assert d < 5e-4, (n, d)
    assert any((after[n] != w).any() for n, w in before.items())


def test_a_token_factory_export_verifies_on_tokens_of_its_vocabulary(tmp_path, capsys):
    """The trainer's record of a token sample (ids below the token folder's vocabulary): export runs the
    transformers model on it before publishing, and verify reads its output object's logits."""
    from export.export_helpers import cli, write_checkpoint
    from tandem.train.checkpoint_meta import input_record

    rec = input_record(torch.tensor([5, 1, 7] * 5 + [2]), vocab=40)
    assert rec == {"shape": [1, 16], "dtype": "int64", "high": 40}
    run = write_checkpoint(tmp_path / "run", {"name": "train.hf_lm:tiny_llama", "vocab": 40, "seq": 16,
                                              "hidden": 32, "layers": 1, "heads": 4}, example_input=rec)
    code, out, err = cli(["export", str(run), "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["example_input"] == {**rec, "kind": "tokens"}
    code, out, err = cli(["export", "verify", str(tmp_path / "out")], capsys)
    assert code == 0 and "its forward gives [1, 16, 40]" in out, out + err
