"""The trainer's phase markers: NVTX ranges on CUDA (Nsight Systems shows tandem's phase names), the
shared no-op context on CPU outside the window, and the CUDA memory step's phase marks. torch.cuda.nvtx
is stood in for (this host has no GPU); tests/gpu/ runs the real thing."""

import contextlib
from types import SimpleNamespace

import torch

from tandem.core.spec import ProfileSpec
from tandem.train.profile import StepProfiler


def _prof(tmp_path, device: str) -> StepProfiler:
    ctx = SimpleNamespace(rank=0, world=1, device=torch.device(device), backend="gloo")
    return StepProfiler(ProfileSpec(enabled=True, start_step=50, nvtx=True), ctx, tmp_path)


def test_phases_are_nvtx_ranges_on_cuda_inside_and_outside_the_window(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.setattr(torch.cuda.nvtx, "range", lambda name: contextlib.nullcontext(calls.append(("range", name))))
    prof = _prof(tmp_path, "cuda")
    with prof.phase("forward"):      # outside the window: NVTX only
        pass
    prof.recording = True            # inside: record_function and NVTX, pushed and popped around the phase
    with prof.phase("backward"):
        calls.append("body")
    assert calls == [("range", "tandem.forward"), ("push", "tandem.backward"), "body", ("pop",)]


def test_cpu_outside_the_window_is_one_shared_no_op(tmp_path):
    prof = _prof(tmp_path, "cpu")
    assert prof.phase("forward") is prof.phase("data")


def test_the_cuda_memory_step_marks_each_phase(tmp_path):
    prof = _prof(tmp_path, "cpu")
    seen = []
    prof._cmem = SimpleNamespace(phase=lambda name, nvtx: contextlib.nullcontext(seen.append(name)))
    with prof.phase("optimizer"):
        pass
    assert seen == ["tandem.optimizer"]
