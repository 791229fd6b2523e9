"""DDP gradient compression and local SGD: bytes per rank per step measured at the process group,
beside uncompressed DDP, and the numerical cost after 3 steps (same data, same initial weights)."""

from __future__ import annotations

import pytest

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
    assert r["losses"][0] == ddp["losses"][0]              # same start
    assert r["losses"][1] == ddp["losses"][1]              # step 1 averaged the models: the same as ddp
    # every rank ends with the same weights: step 3 averaged them
    for k, v in ranks[0]["local-sgd"]["state"].items():
        assert (v - ranks[1]["local-sgd"]["state"][k]).abs().max() < 1e-6, k
