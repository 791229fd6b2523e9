"""What fails in the workers is refused before launch: one line, exit 2, nothing started.

Each test runs the command as a user types it (a subprocess of the `tandem` console script)
and reads its exit code and the one line it prints. `tandem spec` runs the same checks.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tandem_testing import ROOT, one_line_error
from tandem_testing import run_script as tandem

EXAMPLE = str(ROOT / "examples" / "digits_resnet.toml")


def side_by_side(*commands: tuple) -> list:
    """Independent commands of one test, two at a time (each process spends most of its time importing,
    on one core: two use both)."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: tandem(*args), commands))


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_spec_valid_is_one_line():
    r = tandem("spec", EXAMPLE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"valid: {EXAMPLE}; workers 4, grad accumulation 1, effective lr 0.1"]


def test_spec_missing_factory():
    one_line_error(tandem("spec", EXAMPLE, "--model.name", "nosuch.mod:build"),
                   "model.name: cannot import 'nosuch.mod:build'", "No module named 'nosuch'")


def test_spec_fp16_on_cpu_is_valid():
    r = tandem("spec", EXAMPLE, "--precision.dtype", "fp16", "--launch.device", "cpu")
    assert r.returncode == 0, r.stderr


def test_spec_bad_loss_and_clip():
    imp, mean, model, clip = side_by_side(("spec", EXAMPLE, "--model.loss", "nosuch_losses:fn"),
                                          ("spec", EXAMPLE, "--model.loss", "mean"),
                                          ("spec", EXAMPLE, "--model.loss", "model"),
                                          ("spec", EXAMPLE, "--optim.clip_grad_norm", "-1"))
    one_line_error(imp, "model.loss: cannot import 'nosuch_losses:fn'", "Fix: use cross_entropy | model")
    one_line_error(mean, "model.loss: unknown loss (got 'mean')")
    one_line_error(model, "model.loss: the built-in resnet18 returns logits")
    one_line_error(clip, "optim.clip_grad_norm: a gradient norm must be 0 (off) or positive (got -1.0)")


@pytest.mark.skipif("cuda()", reason="checks the CPU-only answer")
def test_spec_cuda_without_gpu():
    one_line_error(tandem("spec", EXAMPLE, "--launch.device", "cuda"),
                   "launch.device: no CUDA device is visible", "Fix: use launch.device=cpu")


FACTORIES = """
import torch

def good(num_classes, in_channels):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))

def raises(num_classes, in_channels):
    raise RuntimeError("weights file\\nnot found")

def not_module(num_classes, in_channels):
    return {"layers": 3}

def sized(num_classes, in_channels, depth=1):  # a keyword of its own: [model] depth = ...
    return torch.nn.Sequential(torch.nn.Flatten(), *[torch.nn.LazyLinear(8) for _ in range(depth)],
                               torch.nn.LazyLinear(num_classes))

def reads(num_classes, in_channels):  # reads a tensor's value: fails on the meta device, fine on a CPU
    scale = float(torch.ones(1).sum().item())
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64 * in_channels, num_classes * int(scale)))
"""


@pytest.mark.parametrize("factory", ["good", "reads"])
def test_spec_factory_in_working_directory(tmp_path, factory):
    """Found without PYTHONPATH, as the workers (`python -m`, the working directory on sys.path) find it;
    a factory that needs real tensors is built for real when the meta build fails."""
    (tmp_path / "mymodels.py").write_text(FACTORIES)
    r = tandem("spec", EXAMPLE, "--model.name", f"mymodels:{factory}", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("valid: "), (r.stdout, r.stderr)


@pytest.mark.parametrize("case, words", [
    ("npz_shape", ["data.path: x has shape (20, 8, 8) and y (20,), expected (N,C,H,W) and (N,)"]),
    ("npz_labels", ["data.path: labels span 0..11, the model has 10 classes", "model.num_classes = 12"]),
    ("raises", ["model.name: factory 'mymodels:raises' raised RuntimeError: weights file not found"]),
    ("not_module", ["model.name: factory 'mymodels:not_module' returned dict, not an nn.Module"]),
    ("typo", ["model.dpeth: factory 'mymodels:sized' takes no keyword 'dpeth'", "did you mean 'model.depth'?"]),
    ("broken_module", ["model.name: cannot import 'broken:build' (NameError: name 'oops' is not defined)"]),
])
def test_train_refuses_before_launch(tmp_path, tiny_spec, case, words):
    (tmp_path / "mymodels.py").write_text(FACTORIES)
    (tmp_path / "broken.py").write_text("oops\n")
    data = tmp_path / "d.npz"
    x = np.zeros((20, 8, 8) if case == "npz_shape" else (20, 1, 8, 8), np.float32)
    np.savez(data, x=x, y=np.arange(20) % (12 if case == "npz_labels" else 10))
    args = {"npz_shape": ["--data.name", "npz", "--data.path", str(data)],
            "npz_labels": ["--data.name", "npz", "--data.path", str(data)],
            "raises": ["--model.name", "mymodels:raises"], "not_module": ["--model.name", "mymodels:not_module"],
            "broken_module": ["--model.name", "broken:build"],
            "typo": ["--model.name", "mymodels:sized", "--model.dpeth", "2"]}[case]
    spec = tiny_spec()
    r = tandem("train", str(spec), *args, cwd=tmp_path)
    one_line_error(r, *words)
    assert not (tmp_path / "run").exists()  # nothing launched, nothing written
    if case == "npz_shape":  # the same check, the same line (one case: each run pays torch's import)
        assert tandem("spec", str(spec), *args, cwd=tmp_path).stderr == r.stderr


def test_token_task_needs_gpt_with_room_for_its_tokens():
    resnet, small = side_by_side(("spec", EXAMPLE, "--data.name", "reverse"),
                                 ("spec", str(ROOT / "examples" / "gpt_reverse.toml"), "--model.vocab", "8"))
    one_line_error(resnet, "data.name: reverse is a token task")
    one_line_error(small, "model.vocab: the reverse task has 11 tokens (digits and a separator), the model's vocabulary 8")


def test_spec_imports_torch_only_when_an_answer_needs_it():
    """The digits example on a built-in ResNet: a verdict without torch (about 2 s of import saved);
    sync_bn asks whether there is a GPU, so torch is loaded (and the answer is the device's); fp16 runs
    on CPU too and asks nothing."""
    code = ("import sys\nfrom tandem.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
            "    print('torch loaded:', 'torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cases = (([], False), (["--launch.device", "cpu", "--precision.dtype", "bf16"], False),
             (["--precision.dtype", "fp16"], False), (["--model.sync_bn", "true"], True))
    with ThreadPoolExecutor(2) as pool:  # independent processes, two at a time
        runs = list(pool.map(lambda c: subprocess.run([sys.executable, "-c", code, "spec", EXAMPLE, *c[0]],
                                                      capture_output=True, text=True, timeout=120, env=env), cases))
    for (args, loaded), r in zip(cases, runs):
        assert r.stdout.splitlines()[-1] == f"torch loaded: {loaded}", (args, r.stdout, r.stderr)
        assert r.returncode == (2 if loaded and not cuda() else 0), (args, r.stderr)
