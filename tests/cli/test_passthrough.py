"""Verbs that pass what follows their script on (launch, submit, train): options before the script are
the verb's and a typo there is refused in one line; everything after the script reaches the script."""

import json

import pytest

from tandem_testing import ROOT, one_line_error, run_tandem

MARKER = "import pathlib, sys\npathlib.Path(__file__).with_suffix('.ran').write_text(repr(sys.argv[1:]))\n"


def test_launch_typo_is_one_line_and_starts_nothing(tmp_path):
    """The issue's own command: before, a worker ran '--nproc-per-nodes' as its script and logs went to runs/launch."""
    script = tmp_path / "mark.py"
    script.write_text(MARKER)
    r = run_tandem("launch", "--nproc-per-nodes", "2", "--run-dir", "runs/typo", str(script), cwd=tmp_path, timeout=60)
    line = one_line_error(r, "--nproc-per-nodes: no such option of tandem launch", "did you mean --nproc-per-node?")
    assert line == ("error: --nproc-per-nodes: no such option of tandem launch. Fix: did you mean "
                    "--nproc-per-node?"), line
    assert not (tmp_path / "runs").exists()  # neither runs/typo nor the default runs/launch
    assert not script.with_suffix(".ran").exists()  # no worker ran the script
    assert r.stdout == ""


def test_script_args_that_look_like_ours_reach_the_script(tmp_path):
    script = tmp_path / "mark.py"
    script.write_text(MARKER)
    r = run_tandem("launch", "--run-dir", str(tmp_path / "run"), str(script), "--nproc-per-node", "3",
                   "--nproc-per-nodes", "--", "x", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert script.with_suffix(".ran").read_text() == repr(["--nproc-per-node", "3", "--nproc-per-nodes", "--", "x"])


def test_double_dash_ends_launch_options(tmp_path):
    script = tmp_path / "mark.py"
    script.write_text(MARKER)
    r = run_tandem("launch", "--run-dir", str(tmp_path / "run"), "--", str(script), "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert script.with_suffix(".ran").read_text() == repr(["--quiet"])


def test_script_arg_after_the_script_is_not_ours_in_the_dry_run():
    """submit: `--nodes 3` after the script is the script's; the dry run keeps it for the script."""
    r = run_tandem("submit", "--on", "slurm", "--dry-run", "examples/hello_dist.py", "--nodes", "3", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "examples/hello_dist.py --nodes 3" in r.stdout
    assert "#SBATCH --nodes=1" in r.stdout


TYPOS = [
    (["submit", "--on", "slurm", "--nodez", "2", "--dry-run", "examples/hello_dist.py"],
     "error: --nodez: no such option of tandem submit. Fix: did you mean --nodes?"),
    (["train", "--strem", "examples/digits_resnet.toml"],
     "error: --strem: no such option of tandem train. Fix: did you mean --stream?"),
    (["train", "--launch.nproc_per_node", "2", "examples/digits_resnet.toml"],
     "error: --launch.nproc_per_node: no such option of tandem train. Fix: a spec override goes after CONFIG"),
    (["launch", "--zzzzzz", "examples/hello_dist.py"],
     "error: --zzzzzz: no such option of tandem launch. Fix: see `tandem launch --help`; the SCRIPT's own options "
     "go after it (or after --)"),
    (["launch", "--nproc-per-nodes=2", "examples/hello_dist.py"],
     "error: --nproc-per-nodes: no such option of tandem launch. Fix: did you mean --nproc-per-node?"),
    # spec: CONFIG is optional, and a typo'd option was read as the name of a spec file
    (["spec", "--jsn", "examples/gpt_reverse.toml"],
     "error: --jsn: no such option of tandem spec. Fix: did you mean --json?"),
    (["spec", "--jsn"], "error: --jsn: no such option of tandem spec. Fix: did you mean --json?"),
    (["spec", "examples/gpt_reverse.toml", "--jsn"],
     "error: --jsn: no such option of tandem spec. Fix: did you mean --json?"),
    (["spec", "examples/gpt_reverse.toml", "--optim.lr=0.1", "-x"],
     "error: -x: no such option of tandem spec. Fix: see `tandem spec --help`; spec overrides are written "
     "--section.key VALUE, after CONFIG"),
    (["spec", "--launch.nproc_per_node", "2", "examples/gpt_reverse.toml"],
     "error: --launch.nproc_per_node: no such option of tandem spec. Fix: a spec override goes after CONFIG"),
    (["train", "examples/digits_resnet.toml", "--strem"],
     "error: --strem: no such option of tandem train. Fix: did you mean --stream?"),
]


@pytest.mark.parametrize("args,line", TYPOS, ids=[" ".join(a[:2]) for a, _ in TYPOS])
def test_typo_before_the_script_is_refused(args, line, capsys, monkeypatch):
    from tandem.cli import main  # in process: a subprocess each costs ~1 s of imports

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    assert e.value.code == 2, out
    assert out.out == "" and out.err.startswith(line) and len(out.err.splitlines()) == 1, out.err


def test_spec_overrides_of_the_defaults_and_a_value_that_starts_with_a_dash(capsys, monkeypatch):
    """No CONFIG: overrides alone apply to the defaults; a value after its key is never taken for a flag."""
    from tandem.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "200")
    main(["spec", "--json", "--schedule.max_steps", "3"])
    assert json.loads(capsys.readouterr().out)["schedule"]["max_steps"] == 3
    main(["spec", "examples/gpt_reverse.toml", "--json", "--optim.weight_decay", "-0.0"])
    assert json.loads(capsys.readouterr().out)["optim"]["weight_decay"] == 0.0
