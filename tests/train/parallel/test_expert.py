"""Mixture of experts and expert parallelism (model.experts, parallel.ep) against one process, and the bytes.

Numerics: the Llama job of parallel_jobs.moe_job (4 experts of 32 units, top 2, a shared expert, capacity
factor 1 so that some tokens drop, z-loss on) from the same initial weights and batches as one process, 3
steps. Each rank routes its own micro-batch with the capacity of its own tokens, as the one process routes
the same micro-batch, so the dropped tokens are the same ones and only the order of floating-point sums
differs. fp32: per-step losses within 1e-5 (relative), gradient norms within 1e-5 (relative), final weights
within 2e-6 (SGD), as test_numerics.py; AdamW weights within 1e-4; bf16 and fp16 autocast 2e-2 / 5e-3.
Measured on 2 cores (fp32): losses equal to 1e-7, weights <= 6e-8 under ddp, ep 2 and ep 4 (SGD), <= 1.2e-7
under tp 2 (experts whole on each tp rank), <= 4.4e-6 under zero2 with AdamW; bf16 8.1e-4, fp16 6e-5;
ep 2 x tp 2 (4 ranks): losses within 1.8e-7, weights <= 1.2e-7 (ddp, zero3, full recompute, 17 slots),
5.5e-6 under zero2 with AdamW, bf16 1.4e-3.

Bytes: every all-to-all (dispatch and combine, forward and backward) hands experts x capacity x h values to
``all_to_all_single``; ``tandem plan --ep`` prices micro_batch x seq x top_k x capacity_factor x h of them,
4 calls per MoE block per micro-batch (6 under full recompute). The shapes here make capacity exact
(32 tokens x 2 / 4 experts x factor 1 = 16 slots), so the two are equal, byte for byte. Under ep x tp each
tp rank dispatches its share of the slots (8 of 16), the planner's s / tp tokens a GPU.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from harness.numerics import run_many, run_steps_single, spawn
from tandem.core.dims import from_spec
from tandem.core.errors import ConfigError
from tandem.core.experts import capacity
from tandem.core.validate import validate
from tandem.train import runtime as rt

jobs = sys.modules.get("parallel_jobs")
if jobs is None:  # loaded by this folder's conftest.py
    raise ImportError("tests/train/parallel/conftest.py did not load parallel_jobs")
moe_job = jobs.moe_job

STEPS = 3
TOL = {"fp32": (1e-5, 2e-6), "bf16": (2e-2, 5e-3), "fp16": (2e-2, 5e-3)}   # fp16: GradScaler, as bf16's
ADAMW_W = 1e-4

WORLD2 = {"moe-ddp": moe_job(), "moe-ep2": moe_job(ep=2), "moe-ep2-zero3": moe_job("zero3", ep=2),
          "moe-ep2-zero2-adamw": moe_job("zero2", ep=2, optim="adamw"),
          "moe-ep2-bf16": moe_job(ep=2, dtype="bf16"),
          # tp splits the attention, the experts stay whole on each tp rank (ep 1)
          "moe-tp2": moe_job(tp=2), "moe-tp2-noloss-parallel": moe_job(tp=2, loss_parallel=False),
          # sequence parallel: the MoE takes the gathered sequence, its output cut back to each rank's share
          "moe-tp2-sp": moe_job(tp=2, sequence_parallel=True),
          # pipeline stages: each stage's router losses join the backward at its output (pp.RouterLosses)
          "moe-pp2-1f1b": moe_job(pp=2, pp_schedule="1f1b"), "moe-pp2-interleaved": moe_job(pp=2, pp_schedule="interleaved"),
          "moe-pp2-gpipe-ac-full": moe_job(pp=2, pp_schedule="gpipe", activation_checkpoint="full")}
WORLD4 = {"moe-ep4": moe_job(world=4, ep=4), "moe-ep2-dp4": moe_job(world=4, ep=2),
          "moe-ep2-dp4-zero3": moe_job("zero3", world=4, ep=2),
          "moe-ep4-zero2-adamw": moe_job("zero2", world=4, ep=4, optim="adamw"),
          "moe-ep2-dp4-ac-full": moe_job(world=4, ep=2, activation_checkpoint="full"),
          "moe-dp2xtp2": moe_job(tp=2, world=4), "moe-dp2xtp2-zero3": moe_job("zero3", tp=2, world=4),
          "moe-ep2-dp4-fp16": moe_job(world=4, ep=2, dtype="fp16"),
          # experts replicated (ep 1) under ZeRO-1 and a 2 x 2 HSDP mesh
          "moe-zero1": moe_job("zero1", world=4), "moe-hsdp": moe_job("hsdp", world=4, dp_shard=2),
          "moe-dp2xpp2": moe_job(world=4, pp=2), "moe-pp2xtp2-bf16": moe_job(world=4, pp=2, tp=2, dtype="bf16")}
# ep x tp: ep groups tp apart ({0, 2}, {1, 3}), each tp rank dispatching its share of the capacity slots
WORLD4_TP = {"moe-ep2xtp2": moe_job(world=4, ep=2, tp=2), "moe-ep2xtp2-zero3": moe_job("zero3", world=4, ep=2, tp=2),
             "moe-ep2xtp2-zero2-adamw": moe_job("zero2", world=4, ep=2, tp=2, optim="adamw"),
             "moe-ep2xtp2-ac-full": moe_job(world=4, ep=2, tp=2, activation_checkpoint="full"),
             "moe-ep2xtp2-bf16": moe_job(world=4, ep=2, tp=2, dtype="bf16"),
             "moe-ep2xtp2-sp-zero2": moe_job("zero2", world=4, ep=2, tp=2, sequence_parallel=True),
             # capacity 17 slots (1.05 x 32 x 2 / 4, rounded up): the tp ranks' shares are 9 and 8
             "moe-ep2xtp2-odd-capacity": moe_job(world=4, ep=2, tp=2)}
WORLD4_TP["moe-ep2xtp2-odd-capacity"].model.capacity_factor = 1.05


# -- quick: the refusals, one line each, before any process ------------------------------------------------

@pytest.mark.parametrize("change, field, text", [
    (dict(top_k=5), "model.top_k", "top_k 5 must be between 1 and experts 4"),
    (dict(top_k=0), "model.top_k", "top_k 0 must be between 1 and experts 4"),
    (dict(capacity_factor=0.0), "model.capacity_factor", "capacity_factor must be positive"),
    (dict(router_aux_loss=-1.0), "model.router_aux_loss", "must be 0 (off) or positive"),
    (dict(experts=-2), "model.experts", "must be 0 (dense) or more"),
    (dict(name="gpt"), "model.experts", "model 'gpt' has none"),
    (dict(ep=3), "parallel.ep", "ep 3 does not divide experts 4 (4 % 3 = 1)"),
    (dict(ep=4, world=2), "parallel.ep", "ep 4 does not divide dp 2"),
    (dict(ep=2, experts=0), "parallel.ep", "model.experts is 0"),
    (dict(ep=2, strategy="zero1"), "parallel.strategy", "ep 2 with strategy 'zero1' is not supported"),
    (dict(ep=2, strategy="hsdp"), "parallel.strategy", "ep 2 with strategy 'hsdp' is not supported"),
    (dict(ep=2, comm_hook="fp16"), "parallel.comm_hook", "ep 2 with a comm hook"),
    # ep x tp trains; with it, what ep alone refuses is refused the same way
    (dict(tp=2, ep=2, strategy="zero1"), "parallel.strategy", "ep 2 with strategy 'zero1' is not supported"),
    (dict(tp=2, ep=2, cp=2, world=8), "parallel.cp", "model.experts 4 with cp 2 is not supported"),
    (dict(pp=2, ep=2, world=8), "parallel.pp", "ep 2 with pp 2 is not supported"),
    (dict(cp=2), "parallel.cp", "model.experts 4 with cp 2 is not supported"),
    (dict(compile=True), "parallel.compile", "model.experts with compile"),
])
def test_bad_moe_and_ep_are_one_line(change, field, text):
    world = change.pop("world", 4)
    s = moe_job(world=world)
    s.model.tied = False
    for k, v in change.items():
        setattr(s.parallel if hasattr(s.parallel, k) else s.model, k, v)
    with pytest.raises(ConfigError) as e:
        validate(s)   # what tandem train and tandem spec run before any process starts (ParallelDims too)
    assert e.value.field == field and text in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


# -- slow: against one process, the bytes against the planner ------------------------------------------------

@pytest.fixture(scope="module")
def world2():
    return spawn(run_many, 2, WORLD2, steps=STEPS, count=True)


@pytest.fixture(scope="module")
def world4():
    return spawn(run_many, 4, WORLD4, steps=STEPS, count=True)


def check(name, spec, results):
    for r in results:
        assert "error" not in r[name], r[name].get("error")
    r = results[0][name]
    ref = run_steps_single(spec, STEPS)
    loss_tol, w_tol = TOL[spec.precision.dtype]
    if spec.optim.name == "adamw" and spec.precision.dtype == "fp32":
        w_tol = ADAMW_W
    for a, b in zip(r["losses"], ref["losses"]):
        assert abs(a - b) <= loss_tol * abs(b), (name, r["losses"], ref["losses"])
    for a, b in zip(r["grad_norms"], ref["grad_norms"]):   # the gradients themselves, all of them, every step
        assert abs(a - b) <= loss_tol * 10 * abs(b), (name, r["grad_norms"], ref["grad_norms"])
    assert r["losses"][-1] < r["losses"][0], "the model learns"
    assert set(r["state"]) == set(ref["state"])   # full expert tensors, gathered from their ep shards
    worst = max((r["state"][k].float() - ref["state"][k].float()).abs().max().item() for k in ref["state"])
    assert worst <= w_tol, (name, worst)
    for other in results[1:]:   # every rank ends with the same full weights
        assert all(torch.equal(other[name]["state"][k], r["state"][k]) for k in r["state"]), name
    exact = spec.precision.dtype == "fp32"
    assert r["eval"][0] == ref["eval"][0] if exact else abs(r["eval"][0][0] - ref["eval"][0][0]) <= 0.02 * \
        ref["eval"][0][1], (name, r["eval"], ref["eval"])
    dl = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    print(f"{name}: {r['dims']} max |weight diff| {worst:.2e} max |loss diff| {dl:.2e}")


def planned_a2a(spec, fwd_passes: int = 1) -> tuple[float, int]:
    """(bytes per call, calls per step) of ``tandem plan``'s ep term for the spec's shape, on this rank's
    micro-batches (terms/expert.py's ep_comm, as the plan's ep-all-to-all op: s / tp tokens a GPU under tp)."""
    from tandem.plan.inputs.hardware import make_cluster
    from tandem.plan.inputs.model import GPTShape, MoEShape
    from tandem.plan.terms.expert import ep_comm

    m, s = spec.model, spec.schedule
    base = GPTShape(layers=m.layers, hidden=m.hidden, heads=m.heads, seq=m.seq, vocab=m.vocab, kv_heads=m.kv_heads,
                    ffn=m.ffn, gated=True, bias=False, norm="rmsnorm", tied=m.tied, learned_pos=False)
    moe = MoEShape(base, experts=m.experts, top_k=m.top_k, expert_ffn=m.expert_ffn, shared=m.shared_experts,
                   capacity_factor=m.capacity_factor)
    act = 2 if spec.precision.dtype in ("bf16", "fp16") else 4
    tp = spec.parallel.tp
    r = ep_comm(moe, s.micro_batch, 1, spec.parallel.ep, act, make_cluster(gpus_per_node=8), tp,
                fwd_passes=fwd_passes)
    dp = spec.launch.nproc_per_node // tp
    return r["bytes_per_call"], r["calls"] * (s.global_batch // dp // s.micro_batch)


def check_bytes(name, spec, results):
    fwd = 2 if spec.parallel.activation_checkpoint == "full" else 1
    per_call, calls = planned_a2a(spec, fwd)
    for r in results:
        got = r[name]["comm"]["all_to_all"]
        assert got["calls"] == calls, (name, got, calls)
        assert got["payload_bytes"] / got["calls"] == per_call, (name, got, per_call)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_moe_on_two_ranks_matches_one_process(world2, name):
    check(name, WORLD2[name], world2)
    if WORLD2[name].parallel.ep > 1:
        check_bytes(name, WORLD2[name], world2)
    else:
        assert "all_to_all" not in world2[0][name]["comm"]   # experts replicated: no routing traffic


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_ep_and_tp_on_four_ranks_match_one_process(world4, name):
    check(name, WORLD4[name], world4)
    if WORLD4[name].parallel.ep > 1:
        check_bytes(name, WORLD4[name], world4)


@pytest.fixture(scope="module")
def world4_tp():
    return spawn(run_many, 4, WORLD4_TP, steps=STEPS, count=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4_TP))
def test_ep_times_tp_on_four_ranks_matches_one_process(world4_tp, name):
    spec = WORLD4_TP[name]
    check(name, spec, world4_tp)
    if spec.model.capacity_factor == 1.0:
        check_bytes(name, spec, world4_tp)   # 16 slots a micro-batch, 8 per tp rank: half ep 2's bytes
        return
    # 17 slots: tp rank 0 dispatches 9 of each expert's, tp rank 1 the other 8; together one micro-batch's
    m, h, mb = spec.model, spec.model.hidden, spec.schedule.micro_batch
    assert capacity(mb * m.seq, m.top_k, m.experts, m.capacity_factor) == 17
    calls = 4 * m.layers * (spec.schedule.global_batch // 2 // mb)
    for rank, r in enumerate(world4_tp):
        got = r[name]["comm"]["all_to_all"]
        share = 9 if rank % 2 == 0 else 8   # tp innermost: even ranks are tp rank 0
        assert got["calls"] == calls and got["payload_bytes"] == calls * m.experts * share * h * 4, (rank, got)


@pytest.mark.slow
def test_planner_bytes_of_the_shapes_are_what_the_runs_sent():
    # the planner's formula on its own (terms/expert.py): 4 x 8 tokens x top 2 x factor 1 x 32 x 4 B
    assert planned_a2a(WORLD2["moe-ep2"]) == (4 * 8 * 2 * 1.0 * 32 * 4, 4 * 4 * 2)
    assert planned_a2a(WORLD2["moe-ep2-bf16"])[0] == 4 * 8 * 2 * 1.0 * 32 * 2
    assert planned_a2a(WORLD4["moe-ep2-dp4-ac-full"], 2)[1] == 6 * 4 * 1
    # ep 2 x tp 2: s / tp tokens a GPU, as many micro-batches as ep 2 alone on 2 ranks (dp 2)
    assert planned_a2a(WORLD4_TP["moe-ep2xtp2"]) == (4 * 8 * 2 * 1.0 * 32 * 4 / 2, 4 * 4 * 2)


# -- tandem train: the example under ep 2, its metrics against tandem plan ------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_moe_example_trains_under_ep2_and_logs_what_plan_predicts(tmp_path, tp):
    from tandem_testing import ROOT, run_tandem
    run = tmp_path / "run"
    r = run_tandem("train", str(ROOT / "examples" / "moe_reverse.toml"), "--launch.run_dir", str(run), "--json",
                   "--parallel.tp", str(tp), "--launch.nproc_per_node", str(2 * tp))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["parallel"] == f"ddp: pp 1 x dp 2 (ep 2 inside dp) x tp {tp} = {2 * tp} ranks"
    # measured 0.668 after 116 steps, 0.669 under tp 2 (dense llama_reverse: 0.87)
    assert out["accuracy"] >= 0.5, out
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert len(steps) == out["step"]
    p = run_tandem("plan", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seq", "16",
                   "--vocab", "16", "--ffn", "192", "--experts", "4", "--top-k", "2", "--expert-ffn", "64",
                   "--capacity-factor", "1.25", "--ep", "2", "--tp", str(tp), "--gpus-per-node", str(2 * tp),
                   "--micro-batch", "32", "--global-batch", "64", "--precision", "fp32", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    op = next(c for c in json.loads(p.stdout)["comm"] if c["name"] == "ep-all-to-all")
    for s in steps[:-1]:   # every full step (the epoch's last is short: fewer tokens, smaller capacity)
        # tp 2: each tp rank dispatches half of every expert's 320 slots
        assert s["ep_all_to_all_bytes_per_call"] == [op["bytes"]] == [327680.0 / tp], (s, op)
        assert s["ep_all_to_all_calls"] == op["calls"] == 8, (s, op)
        # assignments routed: 2 ranks x 32 x 16 tokens x top 2 x 2 blocks, before capacity drops some
        assert sum(s["moe_tokens_per_expert"]) == 2 * 32 * 16 * 2 * 2
        assert 0.0 <= s["moe_dropped_frac"] < 0.5 and s["moe_aux_loss"] > 0
    assert steps[-1]["moe_dropped_frac"] < steps[0]["moe_dropped_frac"]   # the load-balance loss balances


@pytest.mark.slow
def test_ep_that_does_not_divide_the_experts_fails_before_launch(tmp_path):
    from tandem_testing import ROOT, run_tandem
    r = run_tandem("train", str(ROOT / "examples" / "moe_reverse.toml"), "--parallel.ep", "3",
                   "--launch.nproc_per_node", "3", "--launch.run_dir", str(tmp_path / "run"), timeout=60)
    assert r.returncode == 2
    assert "parallel.ep" in r.stderr and "ep 3 does not divide experts 4 (4 % 3 = 1)" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run" / "logs").exists()   # no worker was started


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_ep_evaluation_with_uneven_shares_matches_one_process(tp):
    # tp 2: each tp rank scores the same samples and dispatches its share of every expert's slots
    from harness.moe import eval_uneven
    spec = moe_job(world=2 * tp, ep=2, tp=tp)
    got = spawn(eval_uneven, 2 * tp, spec, n=513)
    ctx = rt.DistContext(0, 1, 0, 1, 0, torch.device("cpu"), "gloo")
    one = moe_job()
    one.launch.nproc_per_node = 1
    ref = eval_uneven(one, ctx, n=513)
    assert all(g == ref for g in got) and ref[1] == 513 * 4, (got, ref)   # 4 scored digits a sample
