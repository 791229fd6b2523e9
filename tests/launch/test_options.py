"""One rule for the launch options, whoever reads them: a job spec's [launch] section and the
flags of `tandem launch`, `tandem bench comm` and `tandem doctor`."""

import dataclasses

import pytest

from tandem.cli import main
from tandem.core.errors import ConfigError
from tandem.core.spec import LaunchSpec
from tandem.core.validate import validate_launch
from tandem.launch.options import FIELDS, check, flag
from tandem_testing import ROOT

OK = [dict(), dict(simulate_nodes=2), dict(simulate_nodes=2, nnodes="2"), dict(simulate_nodes=2, nnodes="1:2"),
      dict(nnodes="1:2", rdzv_endpoint="h:1"), dict(nnodes="2", node_rank=1), dict(device="cpu", backend="gloo")]
BAD = [  # (options, field that is named, words)
    (dict(simulate_nodes=2, nnodes="3"), "nnodes", "does not fit"),
    (dict(simulate_nodes=3, nnodes="1:2"), "nnodes", "does not fit"),
    (dict(nnodes="1:2"), "rdzv_endpoint", "c10d rendezvous endpoint"),
    (dict(nnodes="2:1"), "nnodes", "not a valid range"),
    (dict(nnodes="two"), "nnodes", "expected N or MIN:MAX"),
    (dict(nproc_per_node=0), "nproc_per_node", "at least 1"),
    (dict(device="gpu"), "device", "not one of auto, cpu, cuda"),
    (dict(backend="mpi"), "backend", "not one of auto, gloo, nccl"),
    (dict(device="cpu", backend="nccl"), "backend", "nccl needs CUDA"),
    (dict(max_restarts=-1), "max_restarts", "0 or more"),
    (dict(timeout_s=0), "timeout_s", "must be positive"),
]


@pytest.mark.parametrize("kw", OK)
def test_valid_options_pass_both_namings(kw):
    assert validate_launch(LaunchSpec(**kw)) == LaunchSpec(**kw)
    assert check(LaunchSpec(**kw)) == LaunchSpec(**kw)


@pytest.mark.parametrize("kw,field,words", BAD)
def test_one_rule_named_as_the_user_wrote_it(kw, field, words):
    with pytest.raises(ConfigError, match=words) as spec_err:
        validate_launch(LaunchSpec(**kw))
    assert spec_err.value.field == f"launch.{field}"
    with pytest.raises(ConfigError, match=words) as flag_err:
        check(LaunchSpec(**kw))
    assert flag_err.value.field == flag(field) and flag_err.value.field.startswith("--")


def test_every_launch_spec_field_is_a_flag():
    """LaunchSpec is the one definition: every field but run_dir has a flag, and nothing else does."""
    assert set(FIELDS.values()) == {f.name for f in dataclasses.fields(LaunchSpec)} - {"run_dir"}
    assert flag("timeout_s") == "--timeout" and flag("threads_per_worker") == "--threads-per-worker"


@pytest.mark.parametrize("verb", [["launch"], ["bench", "comm"], ["doctor", "--local"]])
@pytest.mark.parametrize("nnodes,ok", [("3", False), ("1:2", True)])
def test_launch_bench_and_doctor_agree(verb, nnodes, ok, capsys, monkeypatch):
    """`--nnodes 1:2 --simulate-nodes 2` (an elastic job of 2 simulated nodes) is valid for every verb,
    `--nnodes 3 --simulate-nodes 2` for none. The valid case is stopped right after validation."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "200")
    seen = []

    def stop_after(launch):
        seen.append(validate_launch(launch, flag))
        raise SystemExit(0)

    if ok:  # each verb imports check from tandem.launch.options
        for mod in ("tandem.cli.launch", "tandem.cli.bench", "tandem.cli.doctor"):
            monkeypatch.setattr(f"{mod}.check", stop_after)
    args = [*verb, "--nnodes", nnodes, "--simulate-nodes", "2"] + (["examples/hello_dist.py"] if verb == ["launch"] else [])
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    if ok:
        assert code == 0 and seen and seen[0].nnodes == "1:2", out.err
    else:
        assert code == 2, out
        assert "error: --nnodes: --nnodes 3 does not fit --simulate-nodes 2" in out.err, out.err
