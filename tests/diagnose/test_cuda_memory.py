"""The CUDA memory snapshot reader on a synthetic snapshot in torch's documented format
(torch.cuda.memory._snapshot: segments with blocks, device_traces of alloc/free events); the capture
itself runs in tests/gpu/test_diagnose_gpu.py."""

import json
import pathlib
import pickle

from diagnose.synth import TraceBuilder, ddp_step, write_run
from tandem.train.memory_snapshot import load_snapshot, peak_by_category, read
from tandem.diagnose.trace import load_run

P, OPT, BUCKET, OLD_LOSS, A1, A2, G2, T1, T3 = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000, 0x9000, 0x7000, 0x8000


def _ev(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": []}


def _alloc(a, n):
    return [_ev("alloc", a, n)]


def _free(a, n):
    return [_ev("free_requested", a, n), _ev("free_completed", a, n)]


def snapshot():
    """Alive at the start: a parameter, its optimizer state, DDP's bucket and last step's loss (freed
    first). Forward: two activations; backward: a gradient (not a bucket view), a temporary at the
    peak, then a temporary at A2's address once A2 is freed; optimizer: a temporary, zero_grad frees
    the gradient; last, a buffer at A2's address (known at the end, an activation at the peak: the peak
    must still call that block Activation)."""
    trace = (_free(OLD_LOSS, 512) + _alloc(A1, 4096) + _alloc(A2, 8192) + _alloc(G2, 1024) + _alloc(T1, 1536)
             + _free(A2, 8192) + [_ev("free_requested", T1, 1536)] + _alloc(A2, 512) + _free(A2, 512)
             + [_ev("free_completed", T1, 1536)] + _alloc(T3, 512) + _free(G2, 1024) + _free(A1, 4096)
             + _free(T3, 512) + _alloc(A2, 1024) + [{"action": "snapshot", "addr": 0, "size": 0, "stream": 0}])
    blocks = [(P, 1024), (OPT, 2048), (BUCKET, 1024), (A2, 1024)]
    seg = {"device": 0, "address": P, "total_size": 1 << 20, "stream": 0, "segment_type": "small",
           "allocated_size": 5120, "active_size": 5120,
           "blocks": [{"address": a, "size": n, "requested_size": n, "state": "active_allocated", "frames": []}
                      for a, n in blocks] + [{"address": T3, "size": 4096, "state": "inactive", "frames": []}]}
    other = dict(seg, device=1, blocks=[{"address": 0x9000, "size": 999, "state": "active_allocated"}])
    return {"segments": [seg, other], "device_traces": [trace, []]}


STATES = {"Parameter": [P], "Optstate": [OPT], "Buffer": []}
INFO = {"device": 0, "allocated_at_start": 1024 + 2048 + 1024 + 512, "allocator_peak": 18944,
        "phases": [["tandem.forward", 0], ["", 2], ["tandem.backward", 2], ["", 5], ["tandem.optimizer", 5],
                   ["", 7]],
        "captures": [{"allocs": 5, "tensors": dict(STATES, Gradient=[BUCKET, G2])},
                     {"allocs": 7, "tensors": dict(STATES, Gradient=[BUCKET], Buffer=[A2])}]}


def test_the_peak_by_category_from_a_snapshot():
    out = peak_by_category(snapshot(), INFO)
    assert out["Total"] == 18944 == out["check"]["replay_peak"] == INFO["allocator_peak"]
    assert {k: out[k] for k in ("Parameter", "Optstate", "Gradient", "Activation", "Temp", "Other", "Buffer")} == {
        "Parameter": 1024, "Optstate": 2048, "Gradient": 1024 + 1024, "Activation": 4096 + 8192, "Temp": 1536,
        "Other": 0, "Buffer": 0}
    assert out["check"]["start_derived"] == out["check"]["start_allocated"] == 4608


def test_sizes_are_the_requested_bytes_and_the_allocator_blocks_are_kept_beside_them():
    """The allocator's blocks are rounded up (start: 4608 requested in 5120 of blocks): the categories
    count what the tensors asked for, as the trace does; the allocator's figures stay in the check."""
    snap = snapshot()
    for b in snap["segments"][0]["blocks"]:
        b["size"] = max(512, -(-b["size"] // 512) * 512) + 512   # blocks larger than asked
    info = dict(INFO, allocated_at_start=5120 + 4 * 512, allocator_peak=22_000)
    out = peak_by_category(snap, info)
    assert out["Total"] == 18944 and out["Parameter"] == 1024 and out["Other"] == 0
    assert out["check"]["allocator_peak"] == 22_000 and out["check"]["start_allocated"] == 7168


def test_read_a_rank_dir_and_refuse_a_pickle_with_objects(tmp_path):
    (tmp_path / "memory_snapshot.pickle").write_bytes(pickle.dumps(snapshot()))
    (tmp_path / "memory_snapshot.json").write_text(json.dumps(INFO))
    assert read(tmp_path)["Total"] == 18944 and load_snapshot(tmp_path / "memory_snapshot.pickle") == snapshot()
    (tmp_path / "memory_snapshot.pickle").write_bytes(pickle.dumps({"segments": [], "x": pathlib.PurePosixPath("x")}))
    assert "not plain data" in read(tmp_path)["error"]
    assert read(tmp_path / "nowhere") is None

def test_diagnose_reports_the_snapshot_peak(tmp_path):
    tbs = [TraceBuilder(rank) for rank in (0, 1)]
    for tb in tbs:
        ddp_step(tb, 5, 200.0, comm_end=6200.0)
    write_run(tmp_path / "run", tbs, memory_step=6, memory_source="cuda_snapshot")
    for rank in (0, 1):
        d = tmp_path / "run" / "profile" / f"rank-{rank}"
        (d / "memory_snapshot.pickle").write_bytes(pickle.dumps(snapshot()))
        (d / "memory_snapshot.json").write_text(json.dumps(INFO))
    from tandem.diagnose.analyze import analyze

    rep = analyze(load_run(tmp_path / "run"))
    mem = rep["ranks"][1]["memory"]
    assert mem["source"] == "cuda_snapshot" and mem["step"] == 6
    assert mem["peak_mib"]["Total"] == round(18944 / (1 << 20), 3) and mem["check"]["allocator_peak"] == 18944
