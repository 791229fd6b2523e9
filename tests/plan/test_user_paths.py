"""`tandem plan` as a user types it (tandem.cli.main, the console script's entry): exit code and the line printed.

Issue 17's plan items: a calibration plans the cluster it measured, a job spec's gpt, the degree that breaks
the division, the real way to name a model, `pkg.mod:factory` from the current directory as `train` does,
help without emoji, and the assumptions that decide the answer printed next to it.
"""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import tandem
from tandem.cli import main

REPO = Path(tandem.__file__).resolve().parent.parent


def run(capsys, *args):
    """(exit code, stdout, stderr lines) of `tandem ARGS`."""
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps at 80 columns when not on a terminal


def cpu_calibration(path: Path, **over) -> Path:
    """What `tandem bench comm --nproc-per-node 2 --simulate-nodes 2` writes on a CPU host (numbers rounded)."""
    link = lambda bw: {"bandwidth_Bps": bw, "latency_s": 5e-4, "group_size": 2,  # noqa: E731
                       "collectives": {"all_reduce": {"alpha_s": 5e-4, "beta_s_per_byte": 1 / bw, "busbw_Bps": bw}}}
    d = {"schema": "tandem.calibration/1", "host": "vm", "backend": "gloo", "device": "cpu", "world_size": 4,
         "nnodes": 2, "nproc_per_node": 2, "hosts": ["vm", "vm"], "device_name": "cpu",
         "device_memory_bytes": 8 * 2**30, "cores": 2,
         "links": {"intra_node": link(4e8), "inter_node": link(2.5e8)},
         "compute": {"achieved_flops": {"fp32": 4e10, "bf16": 6e8}}}
    d.update(over)
    path.write_text(json.dumps(d))
    return path


def test_cpu_calibration_plans_the_cpu_cluster_it_measured(capsys, tmp_path):
    cal = cpu_calibration(tmp_path / "cal.json")
    code, out, err = run(capsys, "plan", "resnet18", "--calibration", str(cal), "--json")
    assert code == 0 and not err
    d = json.loads(out)
    cl = d["cluster"]
    assert (cl["gpu"], cl["nodes"], cl["gpus_per_node"]) == ("cpu", 2, 2)   # not 1 x 8 A100
    assert cl["intra"] == cl["inter"] == "loopback/gloo (measured)"         # simulated nodes: one machine
    assert d["strategy"]["precision"] == "fp32" and d["memory_per_gpu"]["capacity"] == 4 * 2**30
    # compute at the measured matmul rate x the CNN default efficiency / 0.8, not an A100's
    per_gpu = d["strategy"]["micro_batch"] * d["strategy"]["grad_accum"] * d["model"]["flops_per_sample"]
    assert d["time"]["compute_s"] == pytest.approx(per_gpu / (4e10 * 0.18 / 0.8))
    code, out, err = run(capsys, "plan", "resnet18", "--calibration", str(cal))
    assert code == 0 and "nvlink" not in out and "a100" not in out
    assert "resnet18 on 2x2 cpu workers (loopback/gloo (measured) / loopback/gloo (measured))" in out


@pytest.mark.parametrize("flag, value, field", [("--gpu", "a100-80gb", "gpu"), ("--intra", "nvlink3", "intra"),
                                                ("--inter", "ib-hdr", "inter"), ("--nics-per-node", "8",
                                                                                 "nics-per-node")])
def test_cluster_flags_that_contradict_the_calibration_are_refused(capsys, tmp_path, flag, value, field):
    cal = cpu_calibration(tmp_path / "cal.json")
    code, out, err = run(capsys, "plan", "resnet18", "--calibration", str(cal), flag, value)
    assert code == 2 and not out and len(err) == 1
    assert err[0].startswith(f"error: {field}: ") and "Fix: drop " + flag in err[0]
    assert "2 node(s) x 2 cpu worker(s)" in err[0] and value in err[0]


def test_more_nodes_of_the_measured_kind_reuse_the_links_with_a_note(capsys, tmp_path):
    cal = cpu_calibration(tmp_path / "cal.json")
    code, out, err = run(capsys, "plan", "resnet18", "--calibration", str(cal), "--nodes", "4", "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["cluster"]["nodes"], d["cluster"]["gpus_per_node"]) == (4, 2)
    assert "measured on 2 node(s) x 2 worker(s), planning 4 x 2" in " ".join(d["cluster"]["notes"])


def test_gpu_calibration_names_its_gpu(capsys, tmp_path):
    cal = cpu_calibration(tmp_path / "cal.json", device="cuda", backend="nccl", device_name="NVIDIA A100-SXM4-80GB",
                          hosts=["n0", "n1"], compute={"achieved_flops": {"bf16": 2.5e14}})
    code, out, _ = run(capsys, "plan", "resnet18", "--calibration", str(cal), "--json")
    assert code == 0
    cl = json.loads(out)["cluster"]
    assert (cl["gpu"], cl["intra"], cl["inter"]) == ("a100-80gb", "intra-node/nccl (measured)",
                                                     "network/nccl (measured)")
    code, out, err = run(capsys, "plan", "resnet18", "--calibration", str(cal), "--gpu", "h100")
    assert code == 2 and err[0].startswith("error: gpu: ") and "a100-80gb" in err[0] and "h100-sxm" in err[0]


def test_bench_comm_records_the_cluster_it_measured():
    from tandem.bench import fit

    result = {"host": "vm", "hosts": ["vm", "vm"], "backend": "gloo", "device": "cpu", "world_size": 4,
              "nnodes": 2, "local_world_size": 2, "device_name": "cpu", "device_memory_bytes": 2**33, "cores": 2,
              "rows": []}
    doc = fit.calibration(result, fitted={})
    assert (doc["nproc_per_node"], doc["hosts"], doc["device_name"], doc["device_memory_bytes"], doc["cores"]) == \
        (2, ["vm", "vm"], "cpu", 2**33, 2)


def _plan_spec(capsys, example: str) -> tuple[dict, int]:
    """`tandem plan --config examples/EXAMPLE --json`, and the parameters of the model that spec builds."""
    import torch

    from tandem.core.config import load_spec
    from tandem.models import build_model, count_params

    spec = str(REPO / "examples" / example)
    code, out, err = run(capsys, "plan", "--config", spec, "--json")
    assert code == 0 and not err
    with torch.device("meta"):
        params = count_params(build_model(load_spec(spec, {}, check=False).model))
    return json.loads(out), params


def test_job_spec_gpt_plans_with_its_shape(capsys):
    d, params = _plan_spec(capsys, "gpt_reverse.toml")
    assert (d["model"]["kind"], d["model"]["params"], d["model"]["seq"]) == ("gpt", params, 16)
    assert (d["strategy"]["dp"], d["strategy"]["micro_batch"], d["strategy"]["global_batch"]) == (2, 32, 64)


def test_job_spec_llama_plans_as_a_gated_rmsnorm_decoder(capsys):
    """A model.name = "llama" spec plans with its own shape: SwiGLU, RMSNorm, no biases, rotary positions,
    so the planner's parameter count is the built model's."""
    d, params = _plan_spec(capsys, "llama_reverse.toml")
    assert (d["model"]["name"], d["model"]["kind"], d["model"]["params"]) == ("llama", "gpt", params)


def test_job_spec_moe_plans_its_experts_and_expert_parallelism(capsys):
    """A Llama spec with model.experts plans the mixture it trains (routed experts, the shared one, the
    router) at the spec's parallel.ep: the planner's parameter count is the built model's."""
    d, params = _plan_spec(capsys, "moe_reverse.toml")
    assert (d["model"]["name"], d["model"]["params"]) == ("llama", params)
    assert (d["strategy"]["ep"], d["strategy"]["dp"]) == (2, 2)


def test_pp_that_does_not_divide_names_pp(capsys):
    code, out, err = run(capsys, "plan", "gpt3-175b", "--pp", "3")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: pp: tp 1 x pp 3 = 3 does not divide the 8 GPUs")
    assert "choose --pp among 1, 2, 4, 8" in err[0]
    code, out, err = run(capsys, "plan", "gpt3-175b", "--tp", "3")
    assert code == 2 and err[0].startswith("error: tp: tp 3 x pp 1 = 3")


def test_no_model_names_the_real_ways(capsys):
    code, out, err = run(capsys, "plan")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: model: no model given")
    assert "--model" not in err[0] and "first argument" in err[0] and "--config" in err[0]
    code, out, err = run(capsys, "plan", "gpt")
    assert code == 2 and err[0].startswith("error: layers: a GPT shape needs --layers")


MYMODELS = """
from torch import nn

def tiny(num_classes=10, in_channels=3):
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, num_classes))
"""


def test_factory_in_the_current_directory_imports_like_train(tmp_path, monkeypatch):
    """The console script (not `python -m`: that would put the directory on sys.path itself)."""
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}
    exe = Path(sys.executable).parent / "tandem"

    def plan(*args):
        return subprocess.run([str(exe), "plan", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
    with ThreadPoolExecutor(2) as pool:  # the two commands are independent: their start-ups overlap
        found, missing = pool.submit(plan, "mymodels:tiny", "--input-shape", "3,8,8", "--json"), \
            pool.submit(plan, "nomodels:tiny")
        r, r_missing = found.result(), missing.result()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["params"] == 3 * 4 * 9 + 4 + 144 * 10 + 10
    # train's model builder imports through the same helper: the same directory, no PYTHONPATH
    from tandem.core.spec import ModelSpec
    from tandem.models import build_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert sum(p.numel() for p in build_model(ModelSpec(name="mymodels:tiny")).parameters()) == 1562
    assert str(tmp_path) not in sys.path  # the import did not leave the directory behind
    r = r_missing
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: model: cannot import 'nomodels:tiny'")


def test_no_help_text_of_any_verb_turns_into_an_emoji(capsys):
    """rich replaces :name: by an emoji when name is one (`:factory:` -> a factory)."""
    import typer
    from rich._emoji_codes import EMOJI

    from tandem.cli import app

    found = []

    def walk(cmd, path):
        texts = [cmd.help or "", cmd.short_help or "", cmd.epilog or ""]
        texts += [getattr(p, "help", None) or "" for p in cmd.params]
        for t in texts:
            found.extend((path, m.group(0)) for m in re.finditer(r":(\S*?):", t) if m.group(1).lower() in EMOJI)
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "tandem")
    assert not found
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0 and "pkg.mod:factory model" in out and "\N{FACTORY}" not in out


def test_llama_first_answer_says_why_and_what_fits(capsys):
    code, out, err = run(capsys, "plan", "llama2-7b")
    assert code == 0
    assert "e+03 GiB" not in out                                  # no micro-batch 32 by default
    assumed = next(line for line in out.splitlines() if line.startswith("assumed: "))
    assert "micro-batch 1 x 32 accumulation (none fits: the smallest)" in assumed
    assert "overlap as DDP: gradient buckets all-reduced during backward, the last bucket exposed (default; " \
           "--overlap F to override)" in assumed and "efficiency 0.71 of datasheet peak bf16" in assumed
    assert "suggestion: no micro-batch fits with zero 0" in out and "--zero 3" in out
    code, out, err = run(capsys, "plan", "llama2-7b", "--nodes", "2", "--zero", "3", "--recompute", "selective",
                         "--overlap", "0.5")
    assumed = next(line for line in out.splitlines() if line.startswith("assumed: "))
    assert "(the largest that fits)" in assumed and "1 x ib-hdr NIC(s) per node = 25 GB/s (default" in assumed
    assert "overlap 0.5 of DP communication hidden (given)" in assumed
    assert "(fits)" in out


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("Tesla V100-SXM2-32GB", "v100-32gb"), ("NVIDIA L40S", "l40s"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA B200", None)])
def test_cuda_device_names_map_to_presets(name, preset):
    from tandem.plan.inputs.calibration import match_gpu

    g = match_gpu(name)
    assert (g.name if g else None) == preset


def test_unknown_gpu_is_planned_with_its_measured_memory_and_flops(capsys, tmp_path):
    cal = cpu_calibration(tmp_path / "cal.json", device="cuda", backend="nccl", device_name="NVIDIA B200",
                          device_memory_bytes=180 * 2**30, hosts=["n0", "n1"],
                          compute={"achieved_flops": {"bf16": 1.5e15}})
    code, out, _ = run(capsys, "plan", "resnet18", "--calibration", str(cal), "--json")
    assert code == 0
    d = json.loads(out)
    assert d["cluster"]["gpu"] == "nvidia b200" and d["memory_per_gpu"]["capacity"] == 180 * 2**30
    assert d["cluster"]["peak_flops"] == 1.5e15
