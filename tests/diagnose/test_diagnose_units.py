"""tandem diagnose on synthetic traces: exact shares, clock recovery, section scores, verdicts."""

import gzip
import json
import re

import pytest

from diagnose.synth import TraceBuilder, ddp_step, write_run
from tandem.diagnose.analyze import analyze
from tandem.diagnose.breakdown import step_share
from tandem.diagnose.clock import estimate
from tandem.diagnose.trace import load_run, parse
from tandem_testing import run_tandem


def _parse(tb: TraceBuilder):
    return parse(tb.doc(), tb.rank, tb.meta())


def test_shares_are_exclusive_and_exact_to_a_microsecond():
    tb = TraceBuilder(0)
    tb.step(7, 0, 10000).phase("clock", 0, 50)
    tb.phase("data", 100, 1100).op(150, 1000, "aten::stack")
    tb.phase("forward", 1200, 4200).op(1200, 4000)
    tb.phase("backward", 4300, 8300).op(4300, 7300).c10d(7000, 7050, 1000).comm(7050, 8300, 1000)
    tb.phase("optimizer", 8400, 9400).op(8400, 9400)
    s = step_share(_parse(tb), 7)
    want = {"data": 1000, "compute": 3000 + 2950 + 1000, "comm": 1050, "idle": 950}
    for k, v in want.items():
        assert s.us[k] == pytest.approx(v, abs=1.0), k
    assert s.step_us == pytest.approx(9950, abs=1.0)  # the clock barriers are not part of the step
    assert sum(s.pct(c) for c in want) == pytest.approx(100.0, abs=1e-9)
    assert s.comm_us == pytest.approx(1300, abs=1.0)
    assert s.overlap_pct == pytest.approx(100 * 250 / 1300, abs=0.01)
    # sections leave exposed communication out: the backward is its compute only
    assert s.sections_us["backward"] == pytest.approx(2950, abs=1.0)
    assert s.sections_us["forward"] == pytest.approx(3000, abs=1.0)
    assert s.sections_us["other"] == pytest.approx(950 - 0, abs=1.0)  # idle outside any phase


def _two_ranks(shift_us=0.0, fwd1=3000.0, data=200.0, buckets=1, numel=1000, steps=4, jitter=True):
    """Two ranks that finish each step's last all-reduce at the same true moment; rank 1's clock is
    ``shift_us`` ahead, so every one of its timestamps is too."""
    tbs = [TraceBuilder(0), TraceBuilder(1, shift_us)]
    t = 0.0
    for n in range(1, steps + 1):
        tbs[0].phase("clock", t, t + 30) if n == 1 else None
        tbs[1].phase("clock", t + 7, t + 30 + (3 if jitter else 0)) if n == 1 else None
        comm_end = t + 10 + data + 10 + max(3000, fwd1) + 10 + 2600
        ends = [ddp_step(tb, n, t, fwd=(fwd1 if tb.rank == 1 else 3000), data=data, buckets=buckets,
                         bucket_numel=numel, comm_end=comm_end + (j * 15 if jitter else 0))
                for j, tb in enumerate(tbs)]
        t = max(ends) + 100
    return [_parse(tb) for tb in tbs]


def test_a_250_ms_clock_shift_is_recovered_within_a_millisecond():
    traces = _two_ranks(shift_us=250_000.0)
    c = estimate(traces)
    assert c.method == "collectives" and c.matched >= 3
    assert abs(c.offsets_us[1] - 250_000.0) < 1000.0
    assert abs(c.barrier_offsets_us[1] - 250_000.0) < 1000.0
    assert c.residual_us < 1000.0


def test_one_host_keeps_its_clock_and_a_trailing_collective_does_not_shift_the_match():
    traces = _two_ranks(shift_us=0.0)
    traces[1].comms.append(type(traces[1].comms[0])("gloo:all_reduce", 1e9, 1e9 + 10))  # recorded on rank 1 only
    c = estimate(traces)
    assert c.method == "collectives" and abs(c.offsets_us[1]) < 100
    for t in traces:
        t.meta["host"] = "vm"
    c = estimate(traces)
    assert c.method == "one-host" and c.offsets_us[1] == 0.0 and abs(c.estimated_us[1]) < 100


def test_barriers_alone_align_when_no_collective_matches():
    traces = _two_ranks(shift_us=-250_000.0)
    for t in traces:
        t.comms.clear()
    c = estimate(traces)
    assert c.method == "barriers" and abs(c.offsets_us[1] + 250_000.0) < 1000.0


def test_a_slow_forward_names_its_rank_and_section_not_the_waiting_one():
    rep = analyze(_two_ranks(shift_us=250_000.0, fwd1=9000.0))
    names = [(v["kind"], v["ranks"], v.get("section")) for v in rep["verdicts"]]
    assert ("straggler", [1], "forward") in names
    assert not any(v["kind"] == "straggler" and v["ranks"] == [0] for v in rep["verdicts"])
    assert rep["sections"]["scores"]["1"]["forward"] < 0.75
    # rank 0 waits at the all-reduce, rank 1 arrives late at it (aligned clock: the shift is gone)
    assert rep["ranks"][0]["median"]["comm_pct"] > rep["ranks"][1]["median"]["comm_pct"]
    assert rep["ranks"][1]["lateness_ms"]["per_step"] > 5.0


def test_balanced_ranks_give_no_findings():
    rep = analyze(_two_ranks(shift_us=1234.0))
    assert rep["verdicts"] == []
    assert rep["schema"] == "tandem.diagnose/1"


def test_data_bound_and_the_two_bucket_verdicts():
    rep = analyze(_two_ranks(data=4000.0), spec={"data": {"num_workers": 0}, "parallel": {"bucket_cap_mb": 25}})
    v = [x for x in rep["verdicts"] if x["kind"] == "data-bound"]
    assert v and v[0]["ranks"] == [0, 1] and "data.num_workers" in v[0]["change"]

    many = analyze(_slow_comm(buckets=8, numel=256), spec={"parallel": {"bucket_cap_mb": 0.001}})
    assert [x["kind"] for x in many["verdicts"]] == ["latency-bound"]
    assert many["ranks"][0]["collectives"]["grad_allreduce_per_step"] == 8
    assert "raise parallel.bucket_cap_mb" in many["verdicts"][0]["change"]

    one = analyze(_slow_comm(buckets=1, numel=1 << 20), spec={"parallel": {"bucket_cap_mb": 1000}})
    assert [x["kind"] for x in one["verdicts"]] == ["no-overlap"]
    assert "lower parallel.bucket_cap_mb" in one["verdicts"][0]["change"]


def _slow_comm(buckets: int, numel: int):
    """Both ranks end the backward waiting 3 ms for the last bucket."""
    tbs = [TraceBuilder(0), TraceBuilder(1)]
    t = 0.0
    for n in range(1, 4):
        comm_end = t + 10 + 200 + 10 + 3000 + 10 + 5000
        ends = [ddp_step(tb, n, t, buckets=buckets, bucket_numel=numel, comm_end=comm_end) for tb in tbs]
        t = max(ends) + 100
    return [_parse(tb) for tb in tbs]


def test_load_run_and_the_cli_on_a_written_window(tmp_path):
    traces = []
    for tb in (TraceBuilder(0), TraceBuilder(1, 50_000.0)):
        for k in range(3):  # the window's clock barriers, leaving at the same true moments
            tb.phase("clock", k * 40.0 + tb.rank * 5, k * 40.0 + 30)
        ddp_step(tb, 5, 200.0, comm_end=6200.0)
        traces.append(tb)
    write_run(tmp_path / "run", traces)
    assert [t.rank for t in load_run(tmp_path / "run")] == [0, 1]
    merged = tmp_path / "merged.json.gz"
    page = tmp_path / "report.html"
    p = run_tandem("diagnose", str(tmp_path / "run"), "--json", "--trace", str(merged), "--html", str(page))
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    text = page.read_text()
    assert text.count("<svg") == 1 and "rank 1" in text and "gloo:all_reduce" in text and "<script" not in text
    assert rep["steps"] == [5] and json.loads((tmp_path / "run" / "diagnose.json").read_text()) == rep
    doc = json.load(gzip.open(merged, "rt"))
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}
    steps = {e["pid"]: e["ts"] for e in doc["traceEvents"] if e.get("name") == "ProfilerStep#5"}
    assert abs(steps[1] - steps[0]) < 100  # rank 1's 50 ms clock shift is taken out


def test_a_run_without_a_window_is_a_one_line_error(tmp_path):
    (tmp_path / "run").mkdir()
    p = run_tandem("diagnose", str(tmp_path / "run"))
    assert p.returncode == 2
    assert "error: run_dir: no profiler window" in p.stderr and "--profile.enabled true" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_straggler_that_waited_for_a_cpu_is_blamed_on_its_host():
    traces = _two_ranks(fwd1=9000.0)  # 6 ms of extra forward on rank 1, 4 steps
    for t, queued_ms in zip(traces, (0.5, 5.0)):
        sched = {"runqueue": int(queued_ms * 4e6), "on_cpu": 1, "wall": 1}
        t.meta.update(steps=[1, 2, 3, 4], main_thread_sched_ns=sched)
    v = [x for x in analyze(traces)["verdicts"] if x["kind"] == "straggler"]
    assert [(x["ranks"], x["cause"]) for x in v] == [([1], "cpu-starved")]
    assert "run queue" in " ".join(v[0]["evidence"]) and "oversubscribed" in v[0]["change"]
    traces[1].meta["main_thread_sched_ns"]["runqueue"] = int(1.0 * 4e6)  # waited little: its code is slow
    v = [x for x in analyze(traces)["verdicts"] if x["kind"] == "straggler"]
    assert [(x["ranks"], x["cause"]) for x in v] == [([1], "code-or-device")]


def test_compare_shows_two_runs_side_by_side(tmp_path):
    runs = []
    for name, data in (("a", 200.0), ("b", 4000.0)):
        tbs = [TraceBuilder(0), TraceBuilder(1)]
        for tb in tbs:
            ddp_step(tb, 5, 0.0, data=data, comm_end=data + 5300.0)
        write_run(tmp_path / name, tbs)
        runs.append(tmp_path / name)
    p = run_tandem("diagnose", str(runs[0]), "--compare", str(runs[1]))
    assert p.returncode == 0, p.stderr
    row = next(line for line in p.stdout.splitlines() if "data %" in line)
    assert "+" in row  # the data share went up
    assert "data-bound on every rank" in p.stdout and "no findings" in p.stdout


def test_gpu_kernels_give_the_shares_when_the_trace_has_them():
    """A CUDA step: the shares come from the GPU timeline (kernels on two compute streams, an nccl
    kernel on its own stream, a host-to-device copy, a memset), not from the main thread; a
    cuda_sync event is a wait, not work. Overlap is HTA's: compute kernels during nccl kernels."""
    from diagnose.synth import gpu_event

    tb = TraceBuilder(0)
    tb.events.append({"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}})
    tb.step(3, 0, 10000).phase("clock", 0, 50)
    tb.phase("data", 100, 1100).op(150, 1000, "aten::stack")
    tb.phase("forward", 1150, 4200).op(1150, 4100, "aten::linear")     # the CPU is busy launching throughout
    tb.phase("backward", 4200, 8300).op(4200, 8200, "autograd::engine")
    tb.phase("optimizer", 8300, 9600).op(8300, 9500, "Optimizer.step")
    gpu_event(tb, "Memcpy HtoD (Pageable -> Device)", 1150, 1250, 7, 1, "gpu_memcpy")
    gpu_event(tb, "ampere_sgemm_128x64_nn", 1300, 3000, 7, 2)
    gpu_event(tb, "void at::native::elementwise_kernel<128, 4>", 2500, 4000, 8, 3)   # overlaps on stream 8
    gpu_event(tb, "ampere_sgemm_64x64_tn", 4300, 7000, 7, 4)
    gpu_event(tb, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 6000, 8000, 20, 5)
    gpu_event(tb, "void at::native::multi_tensor_apply_kernel", 8400, 9000, 7, 6)
    gpu_event(tb, "Memset (Device)", 9000, 9100, 7, 7, "gpu_memset")
    gpu_event(tb, "Stream Sync", 9100, 9500, 7, 8, "cuda_sync")
    t = _parse(tb)
    assert len(t.kernels) == 4 and len(t.gpu_comm) == 1 and len(t.gpu_mem) == 2
    s = step_share(t, 3)
    assert s.source == "gpu_kernels"
    want = {"data": 1000 + 100, "compute": 2700 + 2700 + 600 + 100, "comm": 1000, "idle": 9950 - 1100 - 6100 - 1000}
    for k, v in want.items():
        assert s.us[k] == pytest.approx(v, abs=1.0), k
    assert sum(s.pct(c) for c in want) == pytest.approx(100.0, abs=1e-9)
    assert s.comm_us == pytest.approx(2000, abs=1.0) and s.overlap_pct == pytest.approx(50.0, abs=0.01)
    assert s.sections_us["forward"] == pytest.approx(3050, abs=1.0)   # sections: the main thread's ranges
    rep = analyze([t])
    assert rep["ranks"][0]["median"]["shares_from"] == "gpu_kernels"
    assert rep["ranks"][0]["median"]["compute_pct"] == pytest.approx(100 * 6100 / 9950, abs=0.01)


def _gpu_rank(rank: int, shift_us: float = 0.0) -> TraceBuilder:
    """Two steps of a CUDA rank: kernels, an nccl all-reduce kernel whose end every rank shares."""
    from diagnose.synth import gpu_event

    tb = TraceBuilder(rank, shift_us)
    for k, t0 in enumerate((0.0, 10000.0)):
        tb.step(3 + k, t0, t0 + 9000).phase("forward", t0 + 100, t0 + 4000).op(t0 + 100, t0 + 3900)
        gpu_event(tb, "ampere_sgemm_128x64_nn", t0 + 200, t0 + 5000, 7, 10 * k + 1)
        gpu_event(tb, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", t0 + 4000 + 300 * rank, t0 + 7000, 20, 10 * k + 2)
    return tb


def test_hta_traces_carry_each_rank_on_one_clock(tmp_path):
    """--hta DIR: one file per rank with what HTA's loader requires (distributedInfo.rank, an int,
    unique; traceEvents), every rank's events moved onto rank 0's clock; HTA itself reads them when
    installed (it is not a tandem dependency)."""
    from tandem.diagnose.report import hta_traces

    traces = [parse(tb.doc(), tb.rank, tb.meta()) for tb in (_gpu_rank(0), _gpu_rank(1, 250_000.0))]
    n = hta_traces(traces, {0: 0.0, 1: 250_000.0}, tmp_path / "hta")
    files = sorted((tmp_path / "hta").iterdir())
    assert [f.name for f in files] == ["rank-0.json.gz", "rank-1.json.gz"] and n == sum(f.stat().st_size for f in files)
    docs = [json.loads(gzip.decompress(f.read_bytes())) for f in files]
    assert [d["distributedInfo"]["rank"] for d in docs] == [0, 1]
    # HTA 0.5.0 reads the rank as the file's first match of this regex, not by parsing the JSON
    assert [int(re.search(rb'"rank":\s+(\d+)', gzip.decompress(f.read_bytes())).group(1)) for f in files] == [0, 1]
    assert all(d["distributedInfo"]["world_size"] == 2 and d["traceEvents"] for d in docs)
    assert docs[0]["baseTimeNanoseconds"] == docs[1]["baseTimeNanoseconds"]
    nccl = [[e for e in d["traceEvents"] if e["name"].startswith("nccl")] for d in docs]
    assert [e["ts"] + e["dur"] for e in nccl[1]] == [e["ts"] + e["dur"] for e in nccl[0]]   # one clock
    assert all({"ph", "ts", "dur", "pid", "tid", "name", "cat", "args"} <= set(e) for d in docs
               for e in d["traceEvents"] if e["ph"] == "X")
    hta = pytest.importorskip("hta.trace_analysis")
    ta = hta.TraceAnalysis(trace_dir=str(tmp_path / "hta"))
    assert sorted(ta.t.traces) == [0, 1]
    tb = ta.get_temporal_breakdown(visualize=False)
    assert list(tb["rank"]) == [0, 1] and (tb["compute_time(us)"] > 0).all(), tb
