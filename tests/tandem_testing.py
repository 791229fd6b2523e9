"""Test helpers: run the real `tandem` CLI in a subprocess; a small job spec template."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_tandem(*args: str, timeout: float = 240, env: dict | None = None, cwd: Path = ROOT):
    """`python -m tandem ARGS` with its exit code, stdout and stderr (never raises on failure)."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


TANDEM = str(Path(sys.executable).parent / "tandem")


def run_script(*args: str, timeout: float = 240, cwd: Path = ROOT):
    """The `tandem` console script ARGS as a user runs it: unlike `python -m`, no working folder on sys.path
    (a 'pkg.module:factory' is found on PYTHONPATH or where the workers look); no COLUMNS (a pipe: no width)."""
    env = {**{k: v for k, v in os.environ.items() if k != "COLUMNS"}, "PYTHONPATH": str(ROOT)}
    return subprocess.run([TANDEM, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def one_line_error(r, *words: str, start: str = "error: ") -> str:
    """``r`` exited 2 with a single line on stderr, starting with ``start`` and holding every one of ``words``."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def skip_here_fail_in_ci(why: str, what: str):
    """A test needs what this machine lacks (Slurm's packages, an sshd, Ray): skipped here with ``why``,
    failed under CI (CI=true), which must run ``what``."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run {what}: {why}")
    pytest.skip(why)


def snapshot(folder: Path) -> dict:
    """Every file below ``folder`` with its size and mtime: equal snapshots mean nothing was touched."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


TINY = """
name = "tiny"
[model]
name = "{model}"
width = 4
in_channels = 1
num_classes = 10
small_input = true
[data]
name = "digits"
held_out = 0.2
remainder = "{remainder}"
[optim]
lr = 0.4
ref_batch = 256
[schedule]
global_batch = {global_batch}
micro_batch = {micro_batch}
epochs = 1
max_steps = {max_steps}
warmup_steps = 2
log_every = 5
seed = 3
[precision]
dtype = "{dtype}"
[checkpoint]
every_steps = {every}
keep_last = {keep}
[launch]
nproc_per_node = {nproc}
run_dir = "{run_dir}"
"""


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    """Poll ``pred`` (reads files) until it returns a truthy value; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def tandem_in_process(args, capsys, monkeypatch, path=None):
    """tandem.cli.main as the command runs it (a subprocess each costs seconds of imports here)."""
    from tandem.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "200")
    if path is not None:
        monkeypatch.setenv("PATH", path)
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
