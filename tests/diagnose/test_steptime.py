"""Step-time what-ifs without a calibration: links fitted to the window's collective spans, the
planner's step per setting on the run's measured compute time."""

import pytest

from diagnose.synth import TraceBuilder
from diagnose.test_against_plan import _spec
from tandem.diagnose import steptime, whatif
from tandem.diagnose.trace import parse

ALPHA_US, BPS = 500.0, 100e6     # the links the synthetic spans are drawn from
GRAD = 93_824 * 4                # the test GPT's fp32 gradients


def _traces():
    """Two ranks, three steps; per step the loss all-reduce (4 bytes) and two gradient all-reduces
    whose spans are alpha + ring bytes / busbw (2 ranks: ring bytes = bytes); rank 1 waits 300 us
    longer in each (a late peer), which the fit must leave out."""
    out = []
    for rank, extra in ((0, 0.0), (1, 300.0)):
        tb = TraceBuilder(rank)
        for n in (5, 6, 7):
            t = n * 20_000.0
            tb.step(n, t, t + 19_000)
            for k, numel in enumerate((1, 10_000, 50_000)):
                a = t + 100 + 5000 * k
                tb.comm(a, a + ALPHA_US + 4 * numel / BPS * 1e6 + extra, numel)
        out.append(parse(tb.doc(), rank, dict(tb.meta(), device="cpu", backend="gloo")))
    return out


def test_links_are_fitted_to_the_spans_of_the_rank_that_waited_least():
    r = steptime.link_rates(_traces(), 2)
    assert r["alpha_s"] == pytest.approx(ALPHA_US / 1e6, rel=1e-3) and r["busbw_Bps"] == pytest.approx(BPS, rel=1e-3)
    assert r["sizes"] == 3 and r["spans"] == 18


def test_the_planner_step_per_setting_on_the_run_rates():
    spec = _spec()
    med = {"step_ms": 100.0, "data_pct": 5.0, "compute_pct": 60.0, "comm_pct": 30.0, "idle_pct": 5.0,
           "overlap_pct": 0.0}
    rep = {"world": 2, "ranks": [{"rank": k, "median": dict(med),
                                  "collectives": {"grad_allreduce_per_step": 1, "grad_bytes_per_step": GRAD}}
                                 for k in (0, 1)]}
    bucket = [("parallel.bucket_cap_mb 0.0895", {"parallel.bucket_cap_mb": 0.0895})]
    st = steptime.table(rep, spec, _traces(), whatif.alternatives(spec) + bucket)
    assert "no calibration" in st["source"] and "0.5 ms a call" in st["source"] and "100 MB/s" in st["source"]
    now, rows = st["now"], {r["setting"]: r for r in st["rows"]}
    # one 25 MiB bucket: alpha + the ring's bytes over 2 ranks (= the gradient bytes) / busbw
    assert now["comm_ms"] == pytest.approx(0.5 + GRAD / BPS * 1e3, rel=1e-3)
    assert now["compute_ms"] == pytest.approx(60.0) and now["step_ms"] == pytest.approx(60 + now["comm_ms"] + 10)
    # four buckets: four latencies, the same bytes
    assert rows["parallel.bucket_cap_mb 0.0895"]["comm_ms"] == pytest.approx(4 * 0.5 + GRAD / BPS * 1e3, rel=1e-3)
    # the bf16 hook: one latency, half the bytes
    assert rows["parallel.comm_hook bf16"]["comm_ms"] == pytest.approx(0.5 + GRAD / BPS * 1e3 / 2, rel=1e-3)
    # recompute: the planner's extra forward on the measured compute; zero3 gathers the parameters too
    ac = rows["parallel.activation_checkpoint full"]
    assert 1.2 < ac["compute_ms"] / 60.0 < 1.5 and ac["comm_ms"] == pytest.approx(now["comm_ms"])
    assert rows["parallel.strategy zero3"]["comm_ms"] > 1.4 * now["comm_ms"]
    assert ac["vs_now"] == pytest.approx(ac["step_ms"] / now["step_ms"], rel=1e-3)


def test_verdicts_get_their_step_time():
    rep = {"step_time": {"now": {"step_ms": 74.25, "exposed_comm_ms": 4.25},
                         "rows": [{"setting": "parallel.bucket_cap_mb 0.0895", "step_ms": 76.0, "vs_now": 1.024,
                                   "exposed_comm_ms": 5.75}]}}
    vs = [{"kind": "no-overlap", "evidence": [], "setting": {"parallel.bucket_cap_mb": 0.0895}}]
    steptime.annotate(vs, rep)
    assert vs[0]["evidence"] == ["step time (planner on this run's rates): parallel.bucket_cap_mb 0.0895 -> 76 ms "
                                 "a step, 1.02x the model's 74.2 ms for the run as it is (exposed communication "
                                 "5.75 ms, now 4.25)"]


def test_a_calibration_given_is_the_link_source(tmp_path):
    import json

    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"schema": "tandem.calibration/1", "backend": "gloo", "device": "cpu", "world_size": 2,
                               "nnodes": 1, "nproc_per_node": 2, "hosts": ["vm"], "device_name": "cpu", "cores": 2,
                               "links": {"intra_node": {"bandwidth_Bps": 1e9, "latency_s": 1e-3, "group_size": 2}},
                               "compute": {"achieved_flops": {"fp32": 2e10}}}))
    med = {"step_ms": 100.0, "data_pct": 0.0, "compute_pct": 70.0, "comm_pct": 30.0, "idle_pct": 0.0,
           "overlap_pct": 0.0}
    rep = {"world": 2, "ranks": [{"rank": k, "median": dict(med),
                                  "collectives": {"grad_allreduce_per_step": 1, "grad_bytes_per_step": GRAD}}
                                 for k in (0, 1)]}
    st = steptime.table(rep, _spec(), _traces(), [], str(cal))
    assert st["source"].endswith("as measured") and f"links from the calibration {cal}" in st["source"]
    assert st["now"]["comm_ms"] == pytest.approx(1.0 + GRAD / 1e9 * 1e3, rel=1e-3)
