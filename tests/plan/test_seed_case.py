"""The seed's worked case (shared/seed, section 五) and its lessons, as numbers."""

import pytest

from tandem.plan.config import Strategy
from tandem.plan.explain import explain, warnings
from tandem.plan.hardware import make_cluster
from tandem.plan.model import params_only, preset

SEED_TRAIN = dict(global_batch=1024, precision="tf32", optimizer="sgd-momentum", compute_time_s=0.220)


def seed_model():
    m = preset("resnet50")
    m.params = 25_600_000  # the seed rounds ResNet-50 to 25.6M parameters
    return m


def test_gradient_bytes_are_102_4_MB(plan_of, seed_cluster):
    p = plan_of(seed_model(), seed_cluster(), **SEED_TRAIN)
    (op,) = p.comm
    assert op.collective == "all_reduce" and op.group.size == 4
    assert op.bytes == pytest.approx(102.4e6)   # seed: 25.6M x 4 B = 102.4 MB


def test_33_ms_and_13_percent_over_25G_roce(plan_of, seed_cluster):
    p = plan_of(seed_model(), seed_cluster("roce-25"), **SEED_TRAIN)
    assert p.comm_s == pytest.approx(0.033, abs=0.001)            # seed: 102.4 MB / 3.125 GB/s = 33 ms
    assert p.exposed_comm_s / p.step_s == pytest.approx(0.13, abs=0.005)  # seed: about 13%
    assert p.speedup == pytest.approx(3.5, abs=0.05)              # seed: ideal speed-up about 3.5x


def test_82_ms_and_near_30_percent_over_10GbE(plan_of, seed_cluster):
    p = plan_of(seed_model(), seed_cluster("eth-10"), **SEED_TRAIN)
    assert p.comm_s == pytest.approx(0.082, abs=0.001)            # seed: 82 ms
    assert 0.25 < p.exposed_comm_s / p.step_s < 0.30             # seed: close to 30%


def test_fp16_gradients_halve_the_traffic(plan_of, seed_cluster):
    fp32 = plan_of(seed_model(), seed_cluster(), **SEED_TRAIN)
    amp = plan_of(seed_model(), seed_cluster(), **{**SEED_TRAIN, "precision": "fp16"})
    assert amp.comm[0].bytes == pytest.approx(fp32.comm[0].bytes / 2)
    assert amp.comm_s == pytest.approx(fp32.comm_s / 2, rel=0.02)


def test_default_compute_estimate_matches_the_seeds_220_ms(plan_of, seed_cluster):
    t = {k: v for k, v in SEED_TRAIN.items() if k != "compute_time_s"}
    p = plan_of(preset("resnet50"), seed_cluster(), **t)
    assert p.compute_s == pytest.approx(0.220, rel=0.05)


def test_arithmetic_is_explained(plan_of, seed_cluster):
    text = "\n".join(explain(plan_of(seed_model(), seed_cluster(), **SEED_TRAIN)))
    assert "102.4 MB" in text and "3.125 GB/s" in text and "2x(2-1)/2" in text
    assert "13.1% of the step" in text
    assert "Left out" in text and "data loading" in text


def test_more_gpus_is_not_always_faster(plan_of):
    """Seed mistake 1: ResNet-18 on 64 GPUs gets about 20x, not 64x, over a slow network."""
    c = make_cluster("a100-80gb", gpus_per_node=4, nodes=16, inter="eth-10")
    p = plan_of(preset("resnet18"), c, global_batch=64 * 128, precision="tf32", optimizer="sgd-momentum")
    assert 15 < p.speedup < 32
    text = " ".join(explain(p))
    assert "Far from linear: communication" in text and "eth-10" in text
    fast = plan_of(preset("resnet18"), make_cluster("a100-80gb", 4, 16, inter="ib-hdr", nics_per_node=4),
                   global_batch=64 * 128, precision="tf32", optimizer="sgd-momentum")
    assert fast.speedup > 55


def test_batch_without_warmup_warns(plan_of, seed_cluster):
    p = plan_of(seed_model(), seed_cluster(), ref_batch=256, **SEED_TRAIN)
    assert any("no warm-up" in w for w in warnings(p))
    p = plan_of(seed_model(), seed_cluster(), ref_batch=256, warmup_steps=500, **SEED_TRAIN)
    assert not any("warm-up" in w for w in warnings(p))


def test_big_cnn_batch_warns(plan_of):
    c = make_cluster("a100-80gb", 8, 4)
    p = plan_of(params_only(25.6e6), c, global_batch=16384)
    assert not any("8192" in w for w in warnings(p))  # only a CNN's batch limit is known
    p = plan_of(preset("resnet50"), c, global_batch=16384, strategy=Strategy(dp=32, micro_batch=64))
    assert any("8192" in w for w in warnings(p))


def test_train_time_of_90_epochs(plan_of, seed_cluster):
    p = plan_of(seed_model(), seed_cluster(), samples=5e6 * 90, **SEED_TRAIN)
    assert p.steps == 439_454
    assert p.steps * p.step_s / 86400 == pytest.approx(1.29, abs=0.02)  # the seed measured 4.2 days: input-bound
