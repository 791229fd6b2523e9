"""Every usage error of every verb: the command as a user types it, exit 2, click's or tandem's
one line at the end, never a traceback (typer >= 0.20 no longer installs click)."""

import pytest

from tandem.cli import main
from tandem_testing import ROOT, run_tandem


def run_in_process(args, capsys, monkeypatch):
    """tandem.cli.main as the `tandem` command runs it (a subprocess each costs ~1 s of imports)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "200")
    try:
        main(list(args))
        code = 0  # returned: the entry point exits 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err

USAGE = [
    ([], "Usage: tandem"),                                   # bare: help, then exit 2
    (["frobnicate"], "Error: No such command 'frobnicate'."),
    (["train"], "Error: Missing argument 'config'."),
    (["train", "no/such.toml"], "error: config: no such file (got 'no/such.toml')."),
    (["spec", "no/such.toml"], "error: config: no such file"),
    (["spec", "examples/gpt_reverse.toml", "--optim.lrr", "1"], "error: optim.lrr: unknown key. Fix: did you mean 'optim.lr'?"),
    (["launch"], "Error: Missing argument 'script'."),
    (["launch", "no_such_script.py"], "error: script: script not found"),
    (["launch", "--nproc-per-node", "x", "examples/hello_dist.py"], "Error: Invalid value for '--nproc-per-node'"),
    (["demo", "--bogus"], "Error: No such option: --bogus"),
    (["bench"], "Usage: tandem bench"),
    (["bench", "frob"], "Error: No such command 'frob'."),
    (["bench", "comm", "--bogus"], "Error: No such option: --bogus"),
    (["bench", "train", "--workers", "x"], "error: --workers: not a list of integers (got 'x')."),
    (["doctor", "--bogus"], "Error: No such option: --bogus"),
    (["plan", "--gpuz", "3"], "Error: No such option: --gpuz"),
    (["plan"], "error: model: no model given."),
    (["submit", "examples/hello_dist.py"], "Error: Missing option '--on'."),
    (["submit", "--on", "pbs", "examples/hello_dist.py"], "error: --on: 'pbs' is not one of slurm, k8s, ssh, ray."),
    (["status"], "Error: Missing argument 'run_dir'."),
    (["cancel", "no/such/run"], "error: run_dir: no submitted job here (got 'no/such/run')."),
]


@pytest.mark.parametrize("args,line", USAGE, ids=[" ".join(a) or "(bare)" for a, _ in USAGE])
def test_usage_error_is_one_line_and_exit_2(args, line, capsys, monkeypatch):
    code, out = run_in_process(args, capsys, monkeypatch)
    assert code == 2, out
    assert "Traceback" not in out, out
    assert line in out, out


def test_the_installed_command_too():
    """The real entry point in a fresh process: a usage error and --version."""
    import tandem

    r = run_tandem("frobnicate", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "No such command" in r.stderr, r.stderr
    r = run_tandem("--version", timeout=60)
    assert (r.returncode, r.stdout) == (0, f"tandem {tandem.__version__}\n"), r.stderr


@pytest.mark.parametrize("args", [["-h"], ["--help"], ["train", "-h"], ["bench", "comm", "-h"], ["plan", "-h"]])
def test_help(args, capsys, monkeypatch):
    code, out = run_in_process(args, capsys, monkeypatch)
    assert code == 0 and "Usage: tandem" in out, out
