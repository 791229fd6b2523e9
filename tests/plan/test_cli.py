import json

import pytest
import typer
from typer.testing import CliRunner

from tandem.core.errors import ConfigError

KEYS = {
    "model": {"params", "flops_per_sample"},
    "strategy": {"dp", "tp", "pp", "zero", "micro_batch", "global_batch", "grad_accum"},
    "memory_per_gpu": {"params", "grads", "optimizer", "activations", "other", "total", "capacity", "fits"},
    "time": {"compute_s", "comm_s", "exposed_comm_s", "bubble_s", "step_s"},
    "throughput": {"samples_per_s", "tokens_per_s", "tflops_per_gpu", "mfu"},
    "scaling": {"speedup_vs_1gpu", "efficiency"},
    "train_time": {"steps", "seconds", "gpu_hours", "cost"},
}
COMM_KEYS = {"name", "collective", "bytes", "group_size", "link", "time_s", "exposed_s", "chunks", "algorithm",
             "overlap"}
SEED = ["resnet50", "--gpus-per-node", "2", "--nodes", "2", "--inter", "roce-25", "--global-batch", "1024",
        "--precision", "tf32", "--optimizer", "sgd-momentum", "--compute-time", "0.22", "--params", "25.6e6"]


def app():
    try:
        from tandem.cli import app as main_app
        return main_app
    except ImportError:  # other stages not there yet: a tiny app with only `plan`
        from tandem.cli.plan import plan_cmd
        a = typer.Typer()
        a.command("plan")(plan_cmd)
        a.command("noop")(lambda: None)
        return a


def invoke(*args):
    return CliRunner().invoke(app(), ["plan", *args])


def test_json_has_the_documented_keys():
    r = invoke(*SEED, "--json", "--price", "2.5", "--steps", "1000")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    for section, keys in KEYS.items():
        assert keys <= set(d[section]), section
    assert COMM_KEYS <= set(d["comm"][0])
    assert d["comm"][0]["bytes"] == pytest.approx(102.4e6)
    assert d["time"]["comm_s"] == pytest.approx(0.033, abs=0.001)
    assert d["train_time"]["cost"] == pytest.approx(d["train_time"]["gpu_hours"] * 2.5)
    assert isinstance(d["explain"], list) and len(d["explain"]) > 5


def test_table_output():
    r = invoke(*SEED)
    assert r.exit_code == 0, r.output
    assert "33.3 ms (8.33 ms)" in r.output and "3.85x" in r.output   # DDP hides 3 of its 4 buckets


def test_search_json():
    r = invoke("gpt3-175b", "--nodes", "16", "--nics-per-node", "8", "--global-batch", "512", "--search",
               "--json", "--top", "3")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert len(d["plans"]) == 3 and d["search"]["fit"] > 0
    steps = [p["time"]["step_s"] for p in d["plans"]]
    assert steps == sorted(steps)


def test_does_not_fit_suggests_accumulation():
    r = invoke("llama2-7b", "--gpus-per-node", "8", "--global-batch", "512", "--micro-batch", "64",
               "--zero", "3")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "does not fit" in out and "gradient accumulation" in out and "--micro-batch 2" in out


@pytest.mark.parametrize("args,field", [
    (["resnet50", "--dp", "3"], "dp"),                                  # product != GPU count
    (["gpt3-175b", "--tp", "5", "--pp", "1", "--gpus-per-node", "10"], "tp"),  # 96 heads / 5
    (["gpt-1t", "--pp", "3", "--gpus-per-node", "3", "--schedule", "interleaved", "--virtual", "50"],
     "virtual"),                                                        # 42 layers on a stage, 50 chunks
    (["gpt-1t", "--pp", "3", "--gpus-per-node", "3", "--stage-layers", "43,43,43"], "stage-layers"),
    (["gpt-1t", "--pp", "3", "--gpus-per-node", "3", "--stage-layers", "43,x,42"], "stage-layers"),
    (["resnet50", "--micro-batch", "7"], "micro-batch"),
    (["resnet50", "--gpu", "a200"], "gpu"),
    (["resnet50", "--inter", "infiniband9"], "inter"),
    (["resnet50", "--global-batch", "0"], "global-batch"),
    (["--params", "-5"], "params"),
    (["gpt", "--layers", "2", "--hidden", "64"], "heads"),
    (["resnet50", "--tp", "2"], "tp"),                                   # no TP for a CNN
    (["gpt3-175b", "--pp-grad-sync", "sometimes"], "pp-grad-sync"),
])
def test_bad_input_is_a_config_error(args, field):
    r = invoke(*args)
    assert r.exit_code != 0
    assert isinstance(r.exception, ConfigError), r.output
    assert r.exception.field == field
    assert r.exception.fix


def test_unknown_gpu_lists_the_known_ones():
    r = invoke("resnet50", "--gpu", "a200")
    assert "h100-sxm" in str(r.exception) and "rtx4090" in str(r.exception)


def test_main_exits_2_with_one_line(capsys):
    from tandem.cli import main  # an import error here is a failure, never a skip

    with pytest.raises(SystemExit) as e:
        main(["plan", "resnet50", "--gpu", "nope"])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "plan.png"
    r = invoke("gpt3-175b", "--nodes", "16", "--nics-per-node", "8", "--global-batch", "512", "--search",
               "--top", "3", "--plot", str(out))
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_new_assumptions_are_printed():
    r = invoke("llama2-7b", "--gpu", "h100-sxm", "--precision", "fp8", "--pp", "4", "--tp", "2",
               "--micro-batch", "1", "--global-batch", "64", "--overlap-param-gather", "--zero", "1")
    assert r.exit_code == 0, r.output
    assumed = " ".join(r.output.split())
    assert "pipeline stages of 8,8,8,8 layers, embedding first, logits last (the planner's balanced split" in assumed
    assert "fp8 on the linear layers only, attention at the bf16 rate" in assumed
    assert "parameter all-gather during the next forward (--overlap-param-gather, Megatron)" in assumed


def test_assumptions_name_the_split_the_explain_line_names():
    """Interleaved with pp x v dividing the layers: Megatron's even split, in both places (stages.split_name)."""
    r = invoke("llama2-7b", "--pp", "4", "--schedule", "interleaved", "--virtual", "2", "--micro-batch", "1",
               "--global-batch", "64", "--json")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "logits last (Megatron's even split, 32 / (4 x 2) a chunk; --stage-layers to change)" in out
    assert "layers (Megatron's even split, 32 / (4 x 2) a chunk)" in out


def test_pp_grad_sync_step_holds_the_stage_gradients_unsharded():
    """--pp-grad-sync step (torch's pipelining): one reduce-scatter a step and the stage's FP32 gradients held
    unsharded; the default reduce-scatters every micro-batch and keeps them sharded."""
    base = ["gpt3-175b", "--nodes", "32", "--nics-per-node", "8", "--tp", "8", "--pp", "8", "--zero", "2",
            "--global-batch", "64", "--micro-batch", "1", "--json"]
    d = {k: json.loads(invoke(*base, *(["--pp-grad-sync", k] if k else [])).output) for k in ("", "step")}
    calls = {k: next(o["calls"] for o in v["comm"] if o["name"] == "dp-grad") for k, v in d.items()}
    assert calls == {"": 16, "step": 1}
    assert d["step"]["memory_per_gpu"]["grads"] > 8 * d[""]["memory_per_gpu"]["grads"]   # 4 B unsharded vs 2 B / dp 4
    assert any("Gradient sync under the pipeline (pp_grad_sync step)" in x for x in d["step"]["explain"])


UNFIT_70B = ["llama2-70b", "--gpu", "h100-sxm", "--nodes", "8", "--inter", "ib-ndr", "--nics-per-node", "8",
             "--tokens", "1e12", "--price", "2.5"]   # DDP: 1.5 TiB a GPU


def test_a_plan_that_does_not_fit_gets_no_time_or_cost():
    """A number next to 'does not fit' reads as a budget: it gets none, the table says what would make it fit,
    and --strict turns it into a failure for scripts."""
    r = invoke(*UNFIT_70B, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    tt = d["train_time"]
    assert not d["memory_per_gpu"]["fits"] and not tt["fits"]
    assert tt["steps"] > 0 and tt["seconds"] is None and tt["gpu_hours"] is None and tt["cost"] is None
    assert "--zero 3" in tt["to_fit"] and d["time"]["step_s"] > 0   # the step it would take is still there
    table = " ".join(invoke(*UNFIT_70B).output.split())
    assert "does not fit: no time/cost (to fit: --zero 3" in table and "GPU-h" not in table
    assert "not timed or costed" in table
    strict = invoke(*UNFIT_70B, "--strict")
    assert strict.exit_code == 1
    assert invoke(*UNFIT_70B, "--zero", "3", "--micro-batch", "4", "--recompute", "full", "--strict").exit_code == 0


def test_cost_names_its_currency():
    fit = [*UNFIT_70B, "--zero", "3", "--micro-batch", "4", "--recompute", "full"]
    d = json.loads(invoke(*fit, "--json").output)
    assert d["train_time"]["currency"] == "USD" and d["cluster"]["currency"] == "USD"
    assert d["train_time"]["cost"] == pytest.approx(d["train_time"]["gpu_hours"] * 2.5)
    out = " ".join(invoke(*fit).output.split())
    assert f"USD {d['train_time']['cost']:,.0f} at 2.5 USD/GPU-hour" in out and "cost USD" in out
    out = " ".join(invoke(*fit, "--currency", "eur").output.split())
    assert "cost EUR " in out
    bad = invoke(*fit, "--currency", "dollars")
    assert bad.exit_code != 0
