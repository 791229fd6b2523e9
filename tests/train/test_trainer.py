"""The built-in trainer for real: tandem train on 2 gloo workers, checkpoints, exact resume."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tandem_testing import run_tandem


def weights(ckpt: Path, tmp: Path) -> dict:
    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.mark.slow
def test_resume_is_bitwise_identical(tiny_spec, tmp_path):
    """6 steps straight == the same run's step-3 checkpoint resumed for 3 more steps (mid-epoch)."""
    spec = tiny_spec(max_steps=6, every=3, keep=5)
    straight = tmp_path / "run"
    r = run_tandem("train", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["step"] == 6 and result["world"] == 2 and result["grad_accum"] == 2
    ck = straight / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000003", "step-00000006"]
    assert (ck / "latest").read_text().strip() == "step-00000006"

    resumed = tmp_path / "resumed"
    r = run_tandem("train", str(spec), "--launch.run_dir", str(resumed),
                   "--checkpoint.resume", str(ck / "step-00000003"), "--json")
    assert r.returncode == 0, r.stderr
    start = records(resumed, "start")[0]
    assert start["start_step"] == 3 and start["resumed_from"].endswith("step-00000003")
    a = weights(ck / "step-00000006", tmp_path)
    b = weights(resumed / "checkpoints" / "step-00000006", tmp_path)
    for key in ("model", "optim"):
        flat_a, flat_b = _flatten(a[key]), _flatten(b[key])
        assert flat_a.keys() == flat_b.keys()
        for k in flat_a:
            assert torch.equal(flat_a[k], flat_b[k]), k  # bitwise
    # the losses of steps 4..6 are the same numbers too
    la = [s["loss"] for s in records(straight, "step")[3:]]
    lb = [s["loss"] for s in records(resumed, "step")]
    assert la == lb


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.slow
def test_accumulation_matches_more_workers(tiny_spec, tmp_path):
    """2 workers x micro 8 x accum 2 and 1 worker x micro 8 x accum 4 see the same samples per step:
    the same losses (no BatchNorm in this model, so only float summation order differs)."""
    common = ["--model.name", "examples.tiny_models:mlp", "--checkpoint.every_steps", "0",
              "--checkpoint.at_end", "false", "--data.held_out", "0"]
    two = tiny_spec("two.toml", nproc=2, max_steps=5, run_dir=str(tmp_path / "two"))
    one = tiny_spec("one.toml", nproc=1, max_steps=5, run_dir=str(tmp_path / "one"))
    with ThreadPoolExecutor(2) as pool:  # independent runs side by side: their start-ups leave a core idle
        for r in list(pool.map(lambda spec: run_tandem("train", str(spec), *common), (two, one))):
            assert r.returncode == 0, r.stderr
    s2, s1 = records(tmp_path / "two", "start")[0], records(tmp_path / "one", "start")[0]
    assert (s2["grad_accum"], s1["grad_accum"]) == (2, 4)
    l2 = [s["loss"] for s in records(tmp_path / "two", "step")]
    l1 = [s["loss"] for s in records(tmp_path / "one", "step")]
    assert len(l1) == len(l2) == 5
    assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    assert l1[-1] < l1[0]  # it learns


@pytest.mark.slow
def test_simulated_nodes_bf16_learns(tiny_spec, tmp_path):
    spec = tiny_spec(nproc=1, dtype="bf16", max_steps=0, every=0, global_batch=64, micro_batch=32)
    r = run_tandem("train", str(spec), "--launch.simulate_nodes", "2", "--schedule.epochs", "2", "--json")
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    start = records(run, "start")[0]
    assert start["nodes"] == 2 and start["world"] == 2 and start["dtype"] == "bf16"
    assert start["effective_lr"] == pytest.approx(0.4 * 64 / 256)
    evals = records(run, "eval")
    assert len(evals) == 2 and evals[0]["total"] == 359  # round(0.2 x 1797): exact, no padding
    assert evals[-1]["accuracy"] > 0.5
    assert {p.name for p in (run / "logs").iterdir()} >= {"rank-0.log", "rank-1.log"}
    assert json.loads(r.stdout)["accuracy"] == evals[-1]["accuracy"]
