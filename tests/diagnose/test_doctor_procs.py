"""`tandem doctor` with real workers through the launcher: simulated nodes, and a node that never comes."""

from __future__ import annotations

import inspect
import json
import socket
import time

import pytest

from tandem.diagnose.checks import FAIL, PASS, ChecksFailed
from tandem.cli.doctor import doctor_cmd


def _call(**kw):
    """doctor_cmd with its CLI defaults, overridden by kw (typer's OptionInfo holds the defaults)."""
    args = {n: p.default.default for n, p in inspect.signature(doctor_cmd).parameters.items()}
    args.update(kw)
    return doctor_cmd(**args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_doctor_on_two_simulated_nodes(tmp_path):
    out = tmp_path / "doctor.json"
    _call(simulate_nodes=2, nproc_per_node=1, device="cpu", run_dir=tmp_path / "run",
          checkpoint_path=tmp_path / "ckpt", expect_busbw=1e-6, json_out=out)
    doc = json.loads(out.read_text())
    by = {(c["node"], c["name"]): c for c in doc["checks"]}
    # Both simulated nodes ran the node checks; identical results fold into one "all" row.
    assert {c["node"] for c in doc["checks"]} == {"all"}
    assert by[("all", "master port")]["status"] == PASS  # the store is up under the launcher
    assert by[("all", "/dev/shm")]["status"] in (PASS, "warn")
    for name in ("versions match", "clock skew", "shared storage", "all_reduce"):
        assert by[("all", name)]["status"] == PASS, by[("all", name)]
    assert "GB/s busbw" in by[("all", "all_reduce")]["detail"]
    assert not list((tmp_path / "ckpt").glob(".tandem-doctor-*"))  # the token file is cleaned up


def test_unreachable_node_is_a_failure_within_the_timeout(tmp_path):
    """Node 0 of 2 waits for a node 1 that never starts: a fail row, not a hang."""
    out = tmp_path / "doctor.json"
    t0 = time.monotonic()
    with pytest.raises(ChecksFailed) as e:
        _call(nnodes="2", node_rank=0, master_port=_free_port(), timeout=3, nproc_per_node=1, device="cpu",
              run_dir=tmp_path / "run", checkpoint_path=tmp_path, json_out=out)
    assert time.monotonic() - t0 < 60
    assert e.value.exit_code == 1 and "nodes joined" in str(e.value)
    doc = json.loads(out.read_text())
    joined = next(c for c in doc["checks"] if c["name"] == "nodes joined")
    assert joined["status"] == FAIL and "1/2" in joined["detail"] and "every node" in joined["fix"]
