"""DDP gradient compression and local SGD: bytes per rank per step measured at the process group,
beside uncompressed DDP, and the numerical cost after 3 steps (same data, same initial weights)."""

from __future__ import annotations

import pytest
import torch

# one 2-rank run of every hook serves the module's tests (~30 s on 2 cores): the full suite's, not the quick subset's
pytestmark = pytest.mark.slow


def _sent(r, steps_from=0):
    return sum(v["payload_bytes"] for v in r["comm"].values())


@pytest.mark.parametrize("name,ratio,loss_tol", [
    ("hook-fp16", 0.5, 1e-3),      # 16-bit buckets: exactly half the bytes
    ("hook-bf16", 0.5, 1e-3),
])
def test_16_bit_compression_halves_bytes(name, ratio, loss_tol, runs):
    cfgs, ranks = runs(2)
    ddp, r = ranks[0]["ddp"], ranks[0][name]
    assert "error" not in r, r.get("error")
    print(f"\n{name}: {_sent(r):.0f} B/step vs ddp {_sent(ddp):.0f} B/step; losses {r['losses']} vs {ddp['losses']}")
    assert _sent(r) == pytest.approx(ratio * _sent(ddp), rel=1e-9)
    for a, b in zip(r["losses"], ddp["losses"]):
        assert abs(a - b) <= loss_tol * b


def test_powersgd_sends_low_rank_factors(runs):
    """Steps 1-2 run vanilla all-reduce (torch's minimum warm-up); step 3 sends P and Q (rank 2) and the
    uncompressed vectors only."""
    cfgs, ranks = runs(2)
    ddp, r = ranks[0]["ddp"], ranks[0]["hook-powersgd"]
    assert "error" not in r, r.get("error")
    full = _sent(ddp)
    compressed_step = 3 * _sent(r) - 2 * full
    print(f"\npowersgd rank 2: compressed step {compressed_step:.0f} B vs ddp {full:.0f} B "
          f"({full / compressed_step:.1f}x less)")
    assert 0 < compressed_step < full / 4


def test_local_sgd_averages_every_h_steps(runs):
    """No gradient all-reduce; parameters averaged after steps 1 and 3 (every H=2 steps from the first)."""
    cfgs, ranks = runs(2)
    ddp, r = ranks[0]["ddp"], ranks[0]["local-sgd"]
    assert "error" not in r, r.get("error")
    print(f"\nlocal SGD H=2: {_sent(r):.0f} B/step vs ddp {_sent(ddp):.0f} B/step; losses {r['losses']} "
          f"vs {ddp['losses']}")
    assert _sent(r) < _sent(ddp)
    assert r["losses"][0] == ddp["losses"][0]              # same start: same weights, data and kernels
    # Step 1 averaged the models: mean_r(p - lr g_r) is ddp's p - lr mean_r(g_r) in exact arithmetic
    # only; in fp32 each weight may differ in its last bit or two, and which way depends on the CPU's
    # kernels (equal on avx2, 0.5 ulp of the loss apart on avx512, 0.3 on ATen's default). 16 ulps of
    # the loss covers that rounding; a step whose models were not averaged is 3.5% off (step 2 below).
    tol = 16 * torch.finfo(torch.float32).eps * abs(ddp["losses"][1])
    assert abs(r["losses"][1] - ddp["losses"][1]) <= tol
    # step 2 was local (no averaging): the comparison above can tell averaged from not
    assert abs(r["losses"][2] - ddp["losses"][2]) > 1000 * tol
    # every rank ends with the same weights: step 3 averaged them
    for k, v in ranks[0]["local-sgd"]["state"].items():
        assert (v - ranks[1]["local-sgd"]["state"][k]).abs().max() < 1e-6, k
