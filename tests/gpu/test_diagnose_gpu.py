"""GPU check of the profiler window and `tandem diagnose` (skipped without CUDA).

    pytest tests/gpu/test_diagnose_gpu.py -q

On a CUDA machine: the window records CUDA activity (kernels) beside the CPU ops, the trainer's
phases are in the trace, the step after the window runs under the CUDA allocator's history (a
memory snapshot whose replay comes within 20% under the allocator's own peak: requested bytes
against rounded-up blocks), and diagnose reads the run: its shares come from the GPU's kernels and
add up to 100%, its efficiency expectation from the GPU's datasheet preset (no calibration). The
snapshot's categories against the plan are checked on the ~100M GPT in test_train_gpu.py.
"""

import gzip
import json

import pytest
import torch

from tandem_testing import TINY, run_tandem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_cuda_window_has_kernels_phases_and_memory(tmp_path):
    run = tmp_path / "run"
    spec = tmp_path / "job.toml"
    nproc = min(2, torch.cuda.device_count())
    spec.write_text(TINY.format(model="resnet18", remainder="pad", global_batch=16 * nproc, micro_batch=16,
                                max_steps=8, dtype="bf16", every=0, keep=1, nproc=nproc, run_dir=str(run)))
    p = run_tandem("train", str(spec), "--launch.device", "cuda", "--profile.enabled", "true",
                   "--profile.start_step", "3", "--profile.steps", "3", "--checkpoint.at_end", "false")
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.load(gzip.open(run / "profile" / "rank-0" / "trace.json.gz", "rt"))
    cats = {e.get("cat") for e in doc["traceEvents"]}
    names = {e.get("name") for e in doc["traceEvents"]}
    assert "kernel" in cats, cats
    assert {"tandem.forward", "tandem.backward", "tandem.optimizer", "ProfilerStep#3"} <= names
    meta = json.loads((run / "profile" / "rank-0" / "window.json").read_text())
    assert meta["device"].startswith("cuda") and meta["memory_peak_bytes"]["Total"] > 0, meta
    assert meta["memory_source"] == "cuda_snapshot" and meta["memory_step"] == 6, meta
    assert (run / "profile" / "rank-0" / "memory_snapshot.pickle").stat().st_size > 0
    d = run_tandem("diagnose", str(run), "--json")
    assert d.returncode == 0, d.stderr
    rep = json.loads(d.stdout)
    assert rep["world"] == nproc and rep["steps"] == [3, 4, 5]
    for r in rep["ranks"]:  # the shares from the GPU timeline (kernels), exclusive: they add up to the step
        for st in r["steps"]:
            assert st["shares_from"] == "gpu_kernels", st
            assert sum(st[f"{c}_pct"] for c in ("data", "compute", "comm", "idle")) == pytest.approx(100, abs=0.01)
            assert 0 < st["compute_pct"] <= 100, st
    # no calibration: the low-efficiency expectation is the GPU's datasheet preset (or the reason there is none)
    eff = rep["efficiency"]
    assert eff.get("basis") == "datasheet" or "no planner preset" in eff.get("no_expectation", ""), eff
    assert rep["device"]["name"], rep["device"]
    mem = rep["ranks"][0]["memory"]
    chk, peak = mem["check"], mem["peak_mib"]
    # the replay counts requested bytes, the allocator its (rounded-up) blocks: at most that, and close
    assert 0.8 * chk["allocator_peak"] <= chk["replay_peak"] <= chk["allocator_peak"], chk
    assert 0 < chk["start_derived"] <= chk["start_allocated"], chk
    assert abs(sum(v for k, v in peak.items() if k != "Total") - peak["Total"]) < 0.01, peak
    assert peak["Parameter"] > 0 and peak["Activation"] > 0, peak
