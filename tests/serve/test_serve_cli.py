"""`tandem serve` refuses bad options in one line (exit 2) and stops with the replica's reason when the
export cannot load (exit 1)."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem_testing import run_tandem


@pytest.mark.parametrize("args, line", [
    (["--replicas", "0"], "error: --replicas: must be at least 1 (got '0')"),
    (["--replicas", "3:2"], "error: --replicas: MIN is more than MAX (got '3:2')"),
    (["--replicas", "1:x"], "error: --replicas: expected N or MIN:MAX (got '1:x')"),
    (["--scale-up-s", "-1"], "error: --scale-up-s: must not be negative (got -1.0)"),
    (["--max-queue", "0"], "error: --max-queue: must be at least 1 (got 0)"),
    (["--batch-wait-ms", "-1"], "error: --batch-wait-ms: must not be negative (got -1.0)"),
    (["--hang-s", "0"], "error: --hang-s: must be at least 0.1 (got 0.0)"),
    (["--body-timeout-s", "0"], "error: --body-timeout-s: must be at least 0.1 (got 0.0)"),
    (["--max-connections", "1"], "error: --max-connections: must be at least 2 (got 1)"),
    (["--port", "70000"], "error: --port: not a TCP port (got 70000)"),
    (["--tp", "2"], "error: --tp: the export has no tensor-parallel shards (got 2)"),
])
def test_bad_options_are_one_line_and_exit_2(gpt_export, args, line):
    r = run_tandem("serve", str(gpt_export), *args, timeout=60)
    assert r.returncode == 2 and line in r.stderr, r.stderr


def test_not_an_export_is_refused(tmp_path):
    r = run_tandem("serve", str(tmp_path), timeout=60)
    assert r.returncode == 2 and "error: EXPORT_DIR: not an export folder (no config.json)" in r.stderr


@pytest.mark.slow  # a server started to fail (front and replica processes): ~6 s
def test_an_export_that_cannot_load_stops_the_server_with_its_reason(gpt_export, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(gpt_export / "config.json", broken / "config.json")  # no weights
    run = tmp_path / "run"
    r = run_tandem("serve", str(broken), "--port", "0", "--run-dir", str(run), timeout=120)
    assert r.returncode == 1, r.stderr
    assert "error: replica: replica 0 failed to load and warm up" in r.stderr
    assert "model.safetensors is missing" in r.stderr
    assert json.loads((run / "server.json").read_text())["url"].startswith("http://127.0.0.1:")
    assert "serve: stopped" in r.stdout


def test_vs_batch_1_takes_an_export_folder(tmp_path):
    r = run_tandem("bench", "serve", str(tmp_path), "--vs-batch-1", timeout=60)
    assert r.returncode == 2 and "error: URL: --vs-batch-1 takes an export folder" in r.stderr, r.stderr


def test_a_rate_is_sustained_only_with_no_failure_within_the_p99_bound():
    from tandem.bench.serve_batching import sustained

    def res(failed=0, p99=900.0, first=40.0, last=60.0):
        return {"failed": failed, "latency_ms": {"p99": p99}, "p50_first_quarter_ms": first,
                "p50_last_quarter_ms": last}
    assert sustained(res(), 1000)
    assert not sustained(res(failed=1, p99=10.0), 1000)
    assert not sustained(res(p99=1001.0), 1000)
    assert not sustained(res(first=40.0, last=400.0), 1000)  # a queue building up within the bound


def test_plot_without_matplotlib_is_one_clear_error(monkeypatch, tmp_path):
    import sys

    from tandem.bench.serve_plot import check_path, require_matplotlib
    from tandem.core.errors import ConfigError

    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if the `plot` extra were not installed
    with pytest.raises(ConfigError, match="matplotlib is not installed") as e:
        require_matplotlib(tmp_path / "l.png")
    assert "tandem[plot]" in str(e.value.fix)
    with pytest.raises(ConfigError, match="expected a .png path"):
        check_path(tmp_path / "l.svg")


def test_the_plot_axis_reaches_the_replicas_return():
    from tandem.bench.serve_plot import x_extent

    assert x_extent({"duration_s": 6, "kill": None}) == 6
    assert x_extent({"duration_s": 6, "kill": {"at_s": 2.0, "back_after_s": 1.0}}) == 6
    assert x_extent({"duration_s": 6, "kill": {"at_s": 2.0, "back_after_s": 8.0}}) >= 10
