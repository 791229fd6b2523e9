"""--runtime: the rules of the framework being planned, and the CLI's defaults as that runtime runs them."""

import json

import pytest

from tandem.core.errors import ConfigError
from tandem.plan.cost import evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import preset
from tandem.plan.inputs.runtime import RUNTIMES
from tandem.plan.inputs.training import Strategy, Training
from tests.plan.test_cli import invoke

H100 = ["--gpu", "h100-sxm", "--nodes", "8", "--inter", "ib-ndr", "--nics-per-node", "8"]
L70 = ["llama3-70b", *H100, "--zero", "3", "--tp", "4", "--micro-batch", "1", "--recompute", "selective"]


def plan_json(*args):
    r = invoke(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_default_is_tandems_runtime_with_its_kernel_and_gradient_dtype():
    d = plan_json(*L70)
    assert d["runtime"]["name"] == "tandem" and d["strategy"]["runtime"] == "tandem"
    assert d["strategy"]["flash_attention"] and d["strategy"]["attention_kernel"] == "cudnn"   # SDPA on Hopper
    assert d["strategy"]["grad_reduce"] == "fp32"
    assert set(d["runtime"]["rules"]) >= {"attention", "grad_reduce", "zero3_prefetch"}
    assert any(line.startswith("Runtime tandem:") for line in d["explain"])
    out = " ".join(invoke(*L70).output.split())
    assert "runtime tandem" in out and "data-parallel gradients reduced in fp32" in out
    assert "--attention-kernel unfused for eager attention" in out


def test_the_historical_setup_is_one_flag_away():
    new, old = plan_json(*L70), plan_json(*L70, "--attention-kernel", "unfused")
    assert not old["strategy"]["flash_attention"]
    assert old["time"]["step_s"] > 1.2 * new["time"]["step_s"]   # the 1.65x on a whole run
    hist = plan_json(*L70, "--runtime", "megatron-2021")
    assert hist["strategy"]["attention_kernel"] == "unfused" and hist["runtime"]["name"] == "megatron-2021"
    assert hist["time"]["step_s"] == pytest.approx(old["time"]["step_s"], rel=0.02)   # and Megatron's grad dtype
    # a GPU without a flash kernel keeps eager attention, whatever the runtime
    v100 = plan_json("llama2-7b", "--gpu", "v100-32gb", "--precision", "fp16", "--zero", "3")
    assert not v100["strategy"]["flash_attention"]


def test_deepspeed_2021_exposes_zero3_gathers_and_runs_one_rate():
    m, c = preset("llama2-7b"), make_cluster("a100-80gb", 8, 4, inter="ib-hdr", nics_per_node=1)
    s = Strategy(dp=32, zero=3, micro_batch=2, recompute="full", ranks_per_node=8)
    fsdp2 = evaluate(m, c, Training(global_batch=256), s)
    ds = evaluate(m, c, Training(global_batch=256, runtime="deepspeed-2021"), s)
    g2 = next(o for o in fsdp2.comm if o.name == "fsdp-params")
    gd = next(o for o in ds.comm if o.name == "fsdp-params")
    assert gd.time_s == pytest.approx(g2.time_s) and gd.exposed_s == pytest.approx(gd.time_s)
    assert g2.exposed_s < 0.2 * g2.time_s and gd.rule == "none"
    assert ds.efficiency == RUNTIMES["deepspeed-2021"].efficiency == 0.5 and ds.mem_bound_s == 0.0
    assert Training(runtime="deepspeed-2021", efficiency=0.4).efficiency == 0.4   # --efficiency still wins


def test_unknown_runtime_is_one_clear_error():
    with pytest.raises(ConfigError, match="runtime"):
        Training(runtime="jax")
    r = invoke("llama3-8b", "--runtime", "jax")
    assert r.exit_code != 0


def test_search_says_which_runtime():
    d = plan_json("llama3-8b", *H100, "--search", "--top", "2", "--runtime", "megatron")
    assert d["search"]["runtime"] == "megatron" and all(p["runtime"]["name"] == "megatron" for p in d["plans"])
    out = " ".join(invoke("llama3-8b", *H100, "--search", "--top", "1").output.split())
    assert "runtime tandem (" in out


def test_allocator_reserve_is_a_stated_fraction_of_the_tensors():
    base = plan_json(*L70)["memory_per_gpu"]
    d = plan_json(*L70, "--allocator-reserve", "0.05")["memory_per_gpu"]
    tensors = base["total"] - 1024**3   # the CUDA context is not the allocator's
    assert base["reserve"] == 0 and d["reserve"] == pytest.approx(0.05 * tensors)
    assert d["total"] == pytest.approx(base["total"] + d["reserve"])
    assert invoke(*L70, "--allocator-reserve", "2").exit_code != 0
