"""The planner's choice flags (--fsdp, --tp-overlap, --pp-grad-sync, --attention-kernel; the switch --overlap-p2p): a
bad or empty value is one line and exit 2; given where it has no effect, the assumptions say so; the JSON strategy
reports each."""

import json

import pytest

from tandem.cli import main

BASE = ["plan", "llama2-7b", "--gpu", "a100-80gb", "--nodes", "2", "--zero", "3", "--global-batch", "32"]


def _run(capsys, *args):
    try:
        main([*BASE, *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flag,value,choices", [
    ("--fsdp", "fsdp3", "fsdp1, fsdp2"), ("--tp-overlap", "all", "none, bulk, ring"),
    ("--pp-grad-sync", "x", "microbatch, step, round"),
    ("--attention-kernel", "x", "unfused, fused, fa1, triton, fa2, fa3, cudnn"),
    ("--cp-impl", "x", "megatron, torch, allgather")])
def test_a_bad_or_empty_value_is_one_line_and_exit_2(capsys, flag, value, choices):
    field = flag[2:]
    code, _, err = _run(capsys, flag, value)
    assert code == 2
    assert " ".join(err.split()) == f"error: {field}: unknown {field} (got '{value}'). Fix: use one of {choices}"
    code, _, err = _run(capsys, f"{flag}=")
    assert code == 2
    assert " ".join(err.split()) == (f"error: {field}: an empty value is not a choice (got ''). Fix: give {flag} one "
                                     "of its values, or leave it out")


def test_flags_without_effect_are_noted_and_json_reports_them(capsys):
    code, out, _ = _run(capsys, "--zero", "2", "--fsdp", "fsdp1", "--json")
    assert code == 0
    doc = json.loads(out)
    assert {doc["strategy"][k] for k in ("fsdp", "tp_overlap", "pp_grad_sync")} == {"fsdp1", "none", "microbatch"}
    assert any("--fsdp fsdp1 given, but zero 2 < 3" in a for a in doc["assumptions"]), doc["assumptions"]
    # tp 16 on 8-GPU nodes: the ring cannot run, the op is charged in full and the assumption says why
    code, out, _ = _run(capsys, "--nodes", "4", "--global-batch", "32", "--tp", "16", "--zero", "1", "--tp-overlap",
                        "ring", "--micro-batch", "1", "--json")
    assert code == 0, out
    doc = json.loads(out)
    tp = next(o for o in doc["comm"] if o["name"] == "tp-activations")
    assert tp["exposed_s"] == tp["time_s"] and doc["strategy"]["tp_overlap"] == "ring"
    assert any("but the tp group spans 2 nodes: charged in full" in a for a in doc["assumptions"]), doc["assumptions"]


@pytest.mark.parametrize("model,args,why", [
    ("llama2-7b", ("--pp", "2", "--zero", "1"), "zero 1 < 2 (no sharded gradients)"),
    ("llama2-7b", ("--zero", "2"), "pp 1 (no pipeline)"),
    ("mixtral-8x7b", ("--pp", "2", "--zero", "2"), "an MoE model (reduced per micro-batch: not modelled)")])
def test_pp_grad_sync_without_effect_is_noted(capsys, model, args, why):
    main(["plan", model, *BASE[2:], "--pp-grad-sync", "step", *args, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert f"--pp-grad-sync step given, but {why}: it has no effect" in doc["assumptions"], doc["assumptions"]


def test_pp_grad_sync_round_under_1f1b_reads_once_a_step(capsys):
    """Under 1F1B (one chunk a stage) round is step: one reduction a step, and the rule says so; interleaved over
    two rounds it says once a round. Either way the flag has effect: no note."""
    for sched, when in ((("--schedule", "1f1b"), "once a step"), (("--schedule", "interleaved", "--virtual", "2"),
                                                                  "once a round")):
        code, out, _ = _run(capsys, "--pp", "4", "--pp-grad-sync", "round", "--micro-batch", "1", *sched, "--json")
        assert code == 0, out
        doc = json.loads(out)
        rule = next(a for a in doc["assumptions"] if a.startswith("overlap "))
        assert f"reduce-scattered {when}, exposed" in rule, rule
        assert not any(a.startswith("--pp-grad-sync") for a in doc["assumptions"])


@pytest.mark.parametrize("args,note", [
    (("--pp", "4", "--micro-batch", "1", "--schedule", "interleaved", "--virtual", "2"),
     "pipeline sends async, waited before use (--overlap-p2p given: Megatron-core's overlap_p2p_comm)"),
    (("--pp", "4", "--micro-batch", "1", "--schedule", "1f1b"),
     "pipeline sends blocking (--overlap-p2p given, but it needs the interleaved schedule: it has no effect)"),
    (("--pp", "4", "--micro-batch", "2", "--schedule", "interleaved", "--virtual", "2"),
     "pipeline sends blocking (--overlap-p2p given, but m = 4 <= p = 4: every chunk forward is warm-up, no steady "
     "state: it has no effect)"),
    (("--zero", "1",), "--overlap-p2p given, but pp 1 (no pipeline sends): it has no effect")])
def test_overlap_p2p_says_where_it_takes_effect(capsys, args, note):
    """--overlap-p2p hides steady-state sends of the interleaved schedule only (pipeline.py); elsewhere the
    assumptions say it has no effect, and the JSON strategy reports the flag either way."""
    code, out, _ = _run(capsys, "--zero", "1", *args, "--overlap-p2p", "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert note in doc["assumptions"], doc["assumptions"]
    assert doc["strategy"]["overlap_p2p"] is True
    pp = [o for o in doc["comm"] if o["name"] == "pp-p2p"]
    assert all((o["overlap"] == "pp-async") == note.startswith("pipeline sends async") for o in pp)
    if pp and note.startswith("pipeline sends async"):
        assert pp[0]["exposed_s"] < pp[0]["time_s"]
