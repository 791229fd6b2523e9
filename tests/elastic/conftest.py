"""The fault-injection suite: every test here is marked `fault` (pytest -m fault); the session's
reference run, shared by the tests."""

import json
from pathlib import Path

import pytest

from elastic.fault_helpers import final_state, finish, samples_seen, start_train, write_spec


def pytest_configure(config):
    config.addinivalue_line("markers", "fault: the fault-injection suite (tests/elastic; run alone with -m fault)")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.fault)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted run (2 workers, one epoch, checkpoints every 10 steps): the baseline
    every fault test compares its final weights and samples with."""
    d = tmp_path_factory.mktemp("reference")
    spec = write_spec(d / "job.toml", d / "run", straggler_every=10)
    rc, out, err = finish(start_train(spec))
    assert rc == 0, err[-3000:]
    result = json.loads(out)
    return {"dir": d, "run": d / "run", "spec": spec, "result": result,
            "state": final_state(Path(result["checkpoint"])), "samples": samples_seen(d / "run")}


@pytest.fixture(scope="session", autouse=True)
def _pyspy_or_faulthandler():
    """py-spy needs ptrace; where it is installed but may not attach (a locked-down CI
    container), the hang dumps are tested on the faulthandler path instead."""
    import os
    import subprocess
    import sys

    from tandem.launch import hangdump

    exe = hangdump.pyspy_exe()
    if exe is None:
        yield
        return
    child = subprocess.Popen([sys.executable, "-c", "import time\nprint('up', flush=True)\nwhile True: time.sleep(1)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # the interpreter is up: py-spy finds a Python to read
        ok = subprocess.run([exe, "dump", "--pid", str(child.pid)], capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    finally:
        child.kill()
        child.wait()
    if ok:
        yield
        return
    os.environ[hangdump.STACKS_ENV] = "faulthandler"
    print(f"\npy-spy at {exe} cannot attach here: hang dumps tested with faulthandler", file=sys.stderr)
    yield
    os.environ.pop(hangdump.STACKS_ENV, None)
