"""Every usage error of every verb: the command as a user types it, exit 2, one line in tandem's form
(`error: FIELD: what. Fix: ...`), click's own parsing errors included (tandem/cli/usage.py), never a
traceback (typer >= 0.20 no longer installs click). A bare group prints its help."""

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
    (["frobnicate"], "error: frobnicate: no such command of tandem. Fix: see `tandem -h` for its commands"),
    (["trian"], "error: trian: no such command of tandem. Fix: did you mean 'train'?"),
    (["train"], "error: config: missing argument. Fix: tandem train [OPTIONS] CONFIG; see `tandem train -h`"),
    (["train", "no/such.toml"], "error: config: no such file (got 'no/such.toml')."),
    (["spec", "no/such.toml"], "error: config: no such file"),
    (["spec", "examples/gpt_reverse.toml", "--optim.lrr", "1"], "error: optim.lrr: unknown key. Fix: did you mean 'optim.lr'?"),
    (["launch"], "error: script: missing argument. Fix: tandem launch [OPTIONS] SCRIPT"),
    (["launch", "no_such_script.py"], "error: script: script not found"),
    (["launch", "--nproc-per-node", "x", "examples/hello_dist.py"], "error: --nproc-per-node: "),
    (["demo", "--bogus"], "error: --bogus: no such option of tandem demo. Fix: see `tandem demo -h`"),
    (["bench"], "Usage: tandem bench"),
    (["bench", "frob"], "error: frob: no such command of tandem bench."),
    (["bench", "comm", "--bogus"], "error: --bogus: no such option of tandem bench comm."),
    (["bench", "train", "--workers", "x"], "error: --workers: not a list of integers (got 'x')."),
    (["doctor", "--bogus"], "error: --bogus: no such option of tandem doctor."),
    (["plan", "--gpuz", "3"], "error: --gpuz: no such option of tandem plan. Fix: did you mean --gpu?"),
    (["plan"], "error: model: no model given."),
    (["submit", "examples/hello_dist.py"], "error: --on: missing option. Fix: tandem submit [OPTIONS] TARGET"),
    (["submit", "--on", "pbs", "examples/hello_dist.py"], "error: --on: 'pbs' is not one of slurm, k8s, ssh, ray."),
    (["status"], "error: run_dir: missing argument. Fix: tandem status [OPTIONS] RUN_DIR"),
    (["status", "a", "b"], "error: tandem status: got unexpected extra argument(s) (b). Fix: tandem status"),
    (["cancel", "no/such/run"], "error: run_dir: no submitted job here (got 'no/such/run')."),
]


@pytest.mark.parametrize("args,line", USAGE, ids=[" ".join(a) or "(bare)" for a, _ in USAGE])
def test_usage_error_is_one_line_and_exit_2(args, line, capsys, monkeypatch):
    code, out = run_in_process(args, capsys, monkeypatch)
    assert code == 2, out
    assert "Traceback" not in out, out
    assert line in out, out
    if line.startswith("error: "):  # click's own usage errors too: tandem's one line, no usage box
        assert out.strip().splitlines() == [out.strip()], out


def test_the_installed_command_too():
    """The real entry point in a fresh process: a usage error and --version."""
    import tandem

    r = run_tandem("frobnicate", timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "error: frobnicate: no such command of tandem. Fix: see `tandem -h` for its commands\n"
    r = run_tandem("--version", timeout=60)
    assert (r.returncode, r.stdout) == (0, f"tandem {tandem.__version__}\n"), r.stderr


@pytest.mark.parametrize("args", [["-h"], ["--help"], ["train", "-h"], ["bench", "comm", "-h"], ["plan", "-h"]])
def test_help(args, capsys, monkeypatch):
    code, out = run_in_process(args, capsys, monkeypatch)
    assert code == 0 and "Usage: tandem" in out, out


def test_help_piped_keeps_whole_flag_names():
    """Piped (no terminal, no COLUMNS) help was laid out 80 wide, and flag names ended in '…'."""
    from tandem_testing import run_script

    r = run_script("plan", "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and "--overlap-param-gather" in r.stdout and "--no-overlap-param-gather" in r.stdout


@pytest.mark.parametrize("verb", [["plan"], ["train"], ["serve"], ["export"], ["bench", "train"]])
def test_help_in_a_narrow_terminal_folds_rather_than_cuts(verb, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "60")
    main([*verb, "--help"])  # help returns (the entry point then exits 0)
    out = capsys.readouterr().out
    assert "Usage: tandem" in out
    assert "…" not in out, [ln for ln in out.splitlines() if "…" in ln]
    assert max(len(ln) for ln in out.splitlines()) <= 60
