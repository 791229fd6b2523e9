"""Bench comm without processes: bus factors, expected values, sizes, fits, calibration, rendering."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from tandem.bench import fit, report
from tandem.bench.collectives import COLLECTIVES, _pattern, bus_factor, check, numel_for
from tandem.bench.options import CommOptions, check_memory
from tandem.core.units import parse_size
from tandem.core.errors import ConfigError


def test_bus_factors_match_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(name, 4) == pytest.approx(0.75)
    for name in ("broadcast", "reduce", "sendrecv"):
        assert bus_factor(name, 8) == 1.0


def _simulate(name: str, n: int, numel: int) -> list[torch.Tensor]:
    """What each rank's output holds after a correct collective, computed from the inputs by hand."""
    ins = [_pattern(torch.arange(numel, dtype=torch.float64), r) for r in range(n)]
    c = numel // n
    total = sum(ins)
    if name == "all_reduce":
        return [total.clone() for _ in range(n)]
    if name == "reduce":
        return [total.clone()] + [torch.zeros(numel) for _ in range(n - 1)]
    if name == "all_gather":
        return [torch.cat([i[:c] for i in ins]) for _ in range(n)]
    if name == "reduce_scatter":
        return [total[r * c:(r + 1) * c] for r in range(n)]
    if name == "all_to_all":
        return [torch.cat([ins[j][r * c:(r + 1) * c] for j in range(n)]) for r in range(n)]
    if name == "broadcast":
        return [ins[0].clone() for _ in range(n)]
    if name == "sendrecv":
        return [ins[(r - 1) % n].clone() for r in range(n)]
    raise AssertionError(name)


@pytest.mark.parametrize("name", list(COLLECTIVES))
@pytest.mark.parametrize("in_place", [False, True])
def test_expected_values_match_a_hand_simulation(name, in_place):
    n, numel = 3, numel_for(COLLECTIVES[name], 96, 4, 3)
    truth = _simulate(name, n, numel)
    for r in range(n):
        b = COLLECTIVES[name].buffers(numel, r, n, torch.float32, "cpu", in_place)
        b.out.copy_(truth[r][: b.out.numel()].to(torch.float32))
        assert check(b, r) == 0.0
        b.out.add_(1)  # any corruption of the output is caught (reduce: only on its root)
        assert check(b, r) > 0 or (b.check_root_only and r != 0)


def test_divisible_sizes_round_down_like_nccl_tests():
    assert numel_for(COLLECTIVES["all_gather"], 100, 4, 3) == 24
    assert numel_for(COLLECTIVES["all_reduce"], 100, 4, 3) == 25


def test_sizes_and_parse():
    assert parse_size("64K") == 65536 and parse_size("1G") == 1 << 30 and parse_size("8") == 8
    assert CommOptions(min_bytes=8, max_bytes=64, factor=2).sizes() == [8, 16, 32, 64]
    with pytest.raises(ConfigError, match="--max-bytes"):
        parse_size("12 parsecs", "--max-bytes")


@pytest.mark.parametrize("kw,field", [({"collectives": ["allreduce"]}, "--collectives"),
                                      ({"dtype": "fp8"}, "--dtype"), ({"factor": 1}, "--factor"),
                                      ({"min_bytes": 64, "max_bytes": 8}, "--max-bytes"),
                                      ({"mode": "sideways"}, "--mode")])
def test_bad_options_name_the_flag(kw, field):
    with pytest.raises(ConfigError) as e:
        CommOptions(**kw).validate()
    assert e.value.field == field and e.value.fix


def test_all_expands_and_memory_is_checked():
    assert CommOptions(collectives=["all"]).validate().collectives == list(COLLECTIVES)
    with pytest.raises(ConfigError, match="GiB is available"):
        check_memory(CommOptions(max_bytes=1 << 30), procs_on_this_host=4, available=2 << 30)
    check_memory(CommOptions(max_bytes=1 << 20), procs_on_this_host=4, available=2 << 30)


def test_alpha_beta_fit_recovers_a_line():
    alpha, beta = 50e-6, 1 / 5e9
    sizes = [2 ** k for k in range(3, 27)]
    f = fit.fit_alpha_beta(sizes, [alpha + beta * s for s in sizes])
    assert f.alpha_s == pytest.approx(alpha, rel=1e-6) and f.beta_s_per_byte == pytest.approx(beta, rel=1e-6)
    assert f.max_rel_err < 1e-9
    flat = fit.fit_alpha_beta([8, 16, 32], [1e-3, 1e-3, 1e-3])  # latency only: no negative numbers
    assert flat.alpha_s == pytest.approx(1e-3) and flat.beta_s_per_byte >= 0


def test_calibration_schema(tmp_path, fake_result):
    _result = fake_result
    path = tmp_path / "cal.json"
    doc = fit.write_calibration(path, _result())
    assert json.loads(path.read_text()) == doc
    assert doc["schema"] == "tandem.calibration/1" and doc["nnodes"] == 2 and doc["backend"] == "gloo"
    for link in ("intra_node", "inter_node"):
        entry = doc["links"][link]
        ar = entry["collectives"]["all_reduce"]
        assert entry["bandwidth_Bps"] == ar["busbw_Bps"] and entry["latency_s"] == ar["alpha_s"]
        assert ar["alpha_s"] == pytest.approx(1e-4, rel=1e-6)
        assert ar["beta_s_per_byte"] == pytest.approx(1 / 2e9, rel=1e-6)
        assert set(entry["collectives"]) == {"all_reduce", "all_gather"}
    assert doc["compute"]["achieved_flops"] == {"fp32": 1e11, "bf16": 2e9}
    # A later run without compute keeps the FLOP/s an earlier run (or bench train) wrote.
    res = _result()
    res["compute"] = {}
    assert fit.write_calibration(path, res)["compute"]["achieved_flops"]["fp32"] == 1e11


def test_wrong_rows_are_not_fitted_and_render_as_wrong(tmp_path, fake_result):
    _result = fake_result
    res = _result(wrong=True)
    fitted = fit.fits(res)
    assert fitted["intra_node"]["all_reduce"]["alpha_s"] > 0
    from rich.console import Console

    con = Console(record=True, width=200)
    report.print_report(res, fitted, con)
    text = con.export_text()
    assert "WRONG" in text and "inter_node" in text and "alpha" in text
    report.write_csv(tmp_path / "r.csv", res)
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == len(res["rows"]) and rows[0]["ok"] == "False"
    report.write_plot(tmp_path / "p.png", res)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_exits_nonzero_on_wrong_results(tmp_path, monkeypatch, fake_result):
    _result = fake_result
    from tandem.cli import bench as cli
    from tandem.core.errors import WorkerFailure

    monkeypatch.setattr(cli, "measure", lambda opts, wl, run_dir: _result(wrong=True))
    with pytest.raises(WorkerFailure, match="wrong"):
        _comm_cmd(tmp_path)
    assert (tmp_path / "calibration.json").is_file()  # the good numbers are still written


def _comm_cmd(run_dir, **over):
    """`bench comm` as its typer defaults would call it, on a tiny all_reduce sweep."""
    from tandem.cli import bench as cli

    kw = dict(collectives="all_reduce", min_bytes="8", max_bytes="1M", factor=2, dtype="fp32", warmup=1,
              iters=1, mode="both", no_check=False, no_compute=True, nproc_per_node=2, nnodes="1",
              node_rank=0, master_addr="127.0.0.1", master_port=29500, rdzv_endpoint="",
              simulate_nodes=0, timeout=60, device="cpu", backend="auto", run_dir=run_dir,
              json_out=None, csv_out=None, plot=None, calibration=None)
    return cli.comm_cmd(**{**kw, **over})


def test_fit_prefers_in_place_rows(fake_result):
    """Out-of-place all_reduce pays a local copy; the link's numbers come from the in-place rows."""
    res = fake_result()
    for r in res["rows"]:
        if r["mode"] == "out":
            r["time_us"] *= 1.5
            r["busbw_GBps"] /= 1.5
    ar = fit.fits(res)["intra_node"]["all_reduce"]
    inplace = [r for r in res["rows"] if r["link"] == "intra_node" and r["collective"] == "all_reduce"
               and r["mode"] == "in" and r["size"] == 1 << 20][0]
    assert ar["busbw_Bps"] == pytest.approx(inplace["busbw_GBps"] * 1e9)
    assert ar["alpha_s"] == pytest.approx(1e-4, rel=1e-6)


def test_cli_refuses_a_single_rank(tmp_path):
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        _comm_cmd(tmp_path, nproc_per_node=1)
