"""Expert parallelism (tandem/plan/terms/expert.py, memory.states_per_gpu): model states per GPU under ep, token
routing's all-to-all, by hand."""

import pytest

from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import MIXTRAL_8X7B, expert_params, moe_params
from tandem.plan.terms.expert import all_to_all, ep_comm
from tandem.plan.terms.memory import states_per_gpu


def test_expert_parallel_states_per_gpu():
    """Mixtral on 8 GPUs, ep 8, ZeRO-1, bf16 Adam: each GPU holds one expert per layer, the rest whole."""
    m = MIXTRAL_8X7B
    by = {"param": 2, "grad": 2}
    st = states_per_gpu(m, tp=1, pp=1, ep=8, dp=8, zero=1, by=by, optimizer_bytes=12)
    experts = expert_params(m)
    rest = moe_params(m) - experts
    assert st["expert_params_per_gpu"] == experts / 8 and st["dense_params_per_gpu"] == rest
    assert st["params"] == pytest.approx(2 * (experts / 8 + rest))
    # the expert-data-parallel group is dp / ep = 1: its optimizer state is not sharded further
    assert st["optimizer"] == pytest.approx(12 * (experts / 8 + rest / 8))
    with pytest.raises(ValueError):
        states_per_gpu(m, tp=1, pp=1, ep=3, dp=8, zero=1, by=by, optimizer_bytes=12)


def test_all_to_all_inside_and_across_nodes():
    c = make_cluster("h100-sxm", 8, 4, inter="ib-ndr", nics_per_node=8)
    S = 64e6
    assert all_to_all(S, 8, 8, c) == pytest.approx(S * 7 / 8 / 370e9 + 7 * 3e-6)
    # ep 32 over 4 nodes: 7/32 of the bytes on NVLink (370 GB/s achievable), 24/32 through the GPU's NIC (48 GB/s)
    assert all_to_all(S, 32, 8, c) == pytest.approx(S * 7 / 32 / 370e9 + S * 24 / 32 / 48e9 + 31 * 5e-6)
    r = ep_comm(MIXTRAL_8X7B, micro_batch=1, cp=1, ep=8, act_bytes=2, c=c)
    assert r["bytes_per_call"] == 4096 * 2 * 1.0 * 4096 * 2 and r["calls"] == 4 * 32
