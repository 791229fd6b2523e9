from pathlib import Path

import pytest

from tandem.core.config import field_docs, load_spec, parse_overrides
from tandem.core.errors import ConfigError
from tandem.core.validate import effective_lr, grad_accum

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits_resnet.toml"


def test_example_loads_and_overrides_apply():
    spec = load_spec(EXAMPLE, ["--optim.lr", "0.2", "--schedule.epochs=3", "--launch.nproc-per-node", "1",
                               "--launch.simulate_nodes", "0", "--model.small_input", "false"])
    assert spec.optim.lr == 0.2 and spec.schedule.epochs == 3 and spec.launch.nproc_per_node == 1
    assert spec.model.small_input is False
    assert grad_accum(spec, 1) == 4  # 64 = 1 worker x 16 x 4
    assert effective_lr(spec) == pytest.approx(0.2 * 64 / 256)


def test_yaml_and_defaults(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("name: y\nschedule:\n  global_batch: 128\n  micro_batch: 32\n")
    spec = load_spec(p)
    assert spec.name == "y" and spec.schedule.global_batch == 128 and spec.model.name == "resnet18"


@pytest.mark.parametrize("args, field, words", [
    (["--optim.lrr", "0.1"], "optim.lrr", "did you mean 'optim.lr'"),
    (["--optimizer.lr", "0.1"], "optimizer.lr", "unknown key"),
    (["--schedule.global_batch", "1000", "--launch.nproc_per_node", "4", "--launch.simulate_nodes", "0",
      "--schedule.micro_batch", "256"], "schedule.global_batch",
     "global_batch 1000 is not divisible by 4 workers x micro_batch 256 = 1024"),
    (["--schedule.epochs", "two"], "schedule.epochs", "expected int"),
    (["--precision.dtype", "fp8"], "precision.dtype", "not one of"),
    (["--data.name", "npz", "--data.path", "/nonexistent/x.npz"], "data.path", "data file not found"),
    (["--optim.clip_grad_norm", "-0.5"], "optim.clip_grad_norm", "0 (off) or positive"),
    (["--model.loss", "l1"], "model.loss", "unknown loss"),
    (["--launch.device", "cpu", "--model.sync_bn", "true"], "model.sync_bn", "SyncBatchNorm"),
    (["--launch.nnodes", "1:4", "--launch.simulate_nodes", "0"], "launch.rdzv_endpoint", "c10d"),
    (["--optim"], "optim", "missing value"),
    (["--elastic.term_grace_s", "0"], "elastic.term_grace_s", "elastic.save_on_term=false"),
])
def test_bad_input_names_field_and_fix(args, field, words):
    with pytest.raises(ConfigError) as e:
        load_spec(EXAMPLE, args)
    assert e.value.field == field
    assert words in str(e.value)


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[model]\nwidht = 8\n")
    with pytest.raises(ConfigError, match="model.widht: unknown key.*did you mean 'model.width'"):
        load_spec(p)


def test_every_field_documented():
    rows = field_docs()
    assert len(rows) > 40
    assert all(help_ for _, _, _, help_ in rows), [k for k, _, _, h in rows if not h]


def test_override_parsing():
    assert parse_overrides(["--a.b", "1", "--c.d=x=y"]) == {"a.b": "1", "c.d": "x=y"}
    with pytest.raises(ConfigError):
        parse_overrides(["a.b", "1"])


def test_help_lists_every_accepted_value():
    """A field whose values are a fixed set names every one of them in its help (`tandem spec`)."""
    from tandem.core.validate import CHOICES

    helps = {k: h for k, _, _, h in field_docs()}
    missing = {key: [c for c in choices if c not in helps[key]] for key, choices in CHOICES.items()}
    assert not any(missing.values()), missing
    for name in ("resnet18", "resnet34", "resnet50", "gpt", "pkg.module:factory"):  # tandem.models.VALID
        assert name in helps["model.name"], name


def test_builtin_resnets_named_without_torch_match_the_models():
    from tandem.models import BUILTIN
    from tandem.train.datacheck import RESNETS

    assert RESNETS == tuple(BUILTIN)
