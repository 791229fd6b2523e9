"""`tandem train` with the GPT workload under sharded and model-parallel strategies, and bad input
refused before any process starts."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tandem_testing import ROOT, run_tandem

SPEC = ROOT / "examples" / "gpt_reverse.toml"


@pytest.mark.slow
def test_gpt_learns_to_reverse_under_zero3(tmp_path):
    r = run_tandem("train", str(SPEC), "--parallel.strategy", "zero3", "--launch.run_dir", str(tmp_path / "run"),
                   "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["parallel"] == "zero3: pp 1 x dp 2 x tp 1 = 2 ranks"
    assert out["accuracy"] >= 0.9, out       # token accuracy on held-out strings (1.0 measured)
    assert Path(out["checkpoint"]).is_dir()


@pytest.mark.parametrize("args,needle", [
    (["--parallel.tp", "3"], "tp 3 x pp 1 = 3 does not divide the world size 2 (2 % 3 = 2)"),
    (["--parallel.tp", "2", "--model.heads", "3", "--model.hidden", "48", "--model.kv_heads", "3"],
     "heads 3 is not divisible by tp 2 (3 % 2 = 1)"),
    (["--parallel.pp", "2", "--model.tied", "false", "--model.layers", "3", "--parallel.pp_split", "even"],
     "layers 3 do not split evenly into pp 2 x 1 chunk(s) = 2 stages"),
    (["--parallel.pp", "2", "--model.tied", "false", "--schedule.micro_batch", "64", "--schedule.global_batch",
      "64"], "1 micro-batch(es) per step (global_batch 64 / (dp 1 x micro_batch 64)) < pp 2 stages"),
    (["--model.name", "resnet18", "--parallel.tp", "2", "--data.name", "digits"], "model 'resnet18' has none"),
])
def test_bad_parallel_input_fails_before_launch(tmp_path, args, needle):
    r = run_tandem("train", str(SPEC), "--launch.run_dir", str(tmp_path / "run"), *args, timeout=60)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists()   # no worker was started


@pytest.mark.slow
def test_pp_run_prints_held_out_accuracy_equal_to_ddp(tmp_path):
    """Under pp the held-out set is scored by a forward-only pass through the stages. The same job
    under ddp ends with the same weights up to summation order (within 1.2e-7 in fp32, see
    test_numerics), so the two accuracies agree: exactly, unless a near-tie logit flips (a token or two)."""
    common = ["--model.tied", "false", "--schedule.micro_batch", "16", "--schedule.max_steps", "40",
              "--data.num_samples", "4096"]  # 57 steps an epoch: no short last step (pp leaves it out)
    out = {}
    jobs = {"pp": ["--parallel.pp", "2"], "ddp": []}
    # side by side: independent runs (1 thread per worker either way), whose start-ups leave a core idle
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(run_tandem, "train", str(SPEC), *common, *extra, "--launch.run_dir",
                                  str(tmp_path / name)) for name, extra in jobs.items()}
    for name, fut in done.items():
        run, r = tmp_path / name, fut.result()
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads((run / "result.json").read_text())
        line = next(x for x in r.stdout.splitlines() if x.startswith("done: "))
        assert line.endswith(f"held-out accuracy {result['accuracy']:.4f}"), line
        out[name] = result
    assert out["pp"]["parallel"].startswith("ddp: pp 2 x dp 1")
    tokens = round(4096 * 0.1) * 8  # held-out strings x 8 scored answer tokens
    print(f"held-out accuracy: pp {out['pp']['accuracy']:.4f}, ddp {out['ddp']['accuracy']:.4f}")
    assert out["pp"]["step"] == out["ddp"]["step"] == 40
    assert out["pp"]["accuracy"] > 0.2, out  # past chance (0.1): a pass that routes or scores wrong would show
    assert abs(out["pp"]["accuracy"] - out["ddp"]["accuracy"]) <= 2 / tokens, out  # measured: 0.3381 both
