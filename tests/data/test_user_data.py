"""data.name = "pkg.module:factory": a bad factory or a data set of the wrong shape is one line before any
worker starts; a good one trains, evaluates and resumes exactly as the built-in sets do."""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tandem.core.rundir import read_metrics

from tandem_testing import ROOT, one_line_error
from tandem_testing import run_script as tandem

OWN = str(ROOT / "examples" / "own_data.toml")

USER = '''
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

def pairs(seed=0):
    x, y = torch.randn(64, 30), torch.randint(0, 2, (64,))
    return TensorDataset(x, y), TensorDataset(x[:8], y[:8])

def lists():
    return [([1.0] * 30, 1)] * 10, None

def one():
    return TensorDataset(torch.randn(4, 30), torch.zeros(4, dtype=torch.long))

def float_labels():
    return TensorDataset(torch.randn(4, 30), torch.rand(4)), None

def narrow():
    return TensorDataset(torch.randn(4, 10), torch.zeros(4, dtype=torch.long)), None

def big_label():
    return TensorDataset(torch.randn(4, 30), torch.full((4,), 7)), None

class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(30), torch.tensor(0)

def stream():
    return Stream(), None

def broken(path=""):
    raise FileNotFoundError(f"no such file {path!r}")
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "userdata.py").write_text(USER)
    return d


@pytest.mark.parametrize("factory,words", [
    ("nosuchmodule:sets", ["cannot import 'nosuchmodule:sets'", "ModuleNotFoundError", "Fix: use"]),
    ("userdata:nosuch", ["AttributeError", "nosuch"]),
    ("userdata:lists", ["item 0 of the train set is (list, int), not (x, y) tensors", "Fix: return (x, y)"]),
    ("userdata:one", ["returned TensorDataset, not a pair (train, held_out)"]),
    ("userdata:float_labels", ["torch.float32", "integer class label"]),
    ("userdata:narrow", ["the model cannot read the data set's samples", "x (10,)"]),
    ("userdata:big_label", ["label 7 of item 0 is outside the model's 2 classes"]),
    ("userdata:stream", ["IterableDataset", "map-style"]),
    ("userdata:broken", ["raised FileNotFoundError: no such file ''"]),
])
def test_bad_data_factory_is_one_line(user_dir, factory, words, capsys, monkeypatch):
    """`tandem spec` in this process (tandem.cli.main, as the console script runs it): what each would print."""
    from tandem.cli import main

    monkeypatch.chdir(user_dir)
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        main(["spec", OWN, "--data.name", factory])
    err = capsys.readouterr().err
    one_line_error(subprocess.CompletedProcess([], e.value.code, "", err), *words, start="error: data.name: ")


def test_train_refuses_before_any_worker(user_dir):
    run = user_dir / "run"
    with ThreadPoolExecutor(2) as pool:  # independent commands: their start-ups overlap
        bad = pool.submit(tandem, "train", OWN, "--data.name", "userdata:lists", "--launch.run_dir", str(run),
                          cwd=user_dir)
        good = pool.submit(tandem, "spec", OWN, "--data.name", "userdata:pairs", cwd=user_dir)
        r, ok = bad.result(), good.result()
    one_line_error(r, "not (x, y) tensors", start="error: data.name: ")
    assert not run.exists()
    assert ok.returncode == 0, ok.stderr


def _steps(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "step"}  # this attempt's


@pytest.mark.slow
def test_own_data_trains_and_resumes_exactly(tmp_path):
    """2 epochs straight, and 1 epoch then a resume to 2: the same losses at every step of epoch 2."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    with ThreadPoolExecutor(2) as pool:  # two independent runs (own run dirs): start-ups overlap
        r, first = pool.map(lambda a: tandem(*a), [
            ("train", OWN, "--schedule.epochs", "2", "--launch.run_dir", str(straight), "--json"),
            ("train", OWN, "--schedule.epochs", "1", "--launch.run_dir", str(split))])
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["accuracy"] > 0.9  # benign vs malignant, from 30 measurements
    assert first.returncode == 0, first.stderr
    r = tandem("train", OWN, "--schedule.epochs", "2", "--launch.run_dir", str(split), "--json")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in (split / "logs" / "rank-0.attempt2.log").read_text()  # the second start's log
    a, b = _steps(straight), _steps(split)
    assert min(b) > 1 and set(b) == {s for s in a if s >= min(b)}
    assert all(a[s] == b[s] for s in b), [(s, a[s], b[s]) for s in b if a[s] != b[s]]
    assert json.loads(r.stdout)["accuracy"] == result["accuracy"]


def test_one_sample_through_the_meta_model_in_eval_mode():
    """BatchNorm cannot train on a batch of one: the check runs the model in eval mode, and puts it back."""
    import torch
    from torch import nn

    from tandem.core.errors import DataError
    from tandem.data.user import check_against_model

    class Dict(nn.Module):  # a model that returns its logits in a dict, as Hugging Face models do
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(30, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

        def forward(self, x):
            return {"logits": self.body(x)}

    with torch.device("meta"):
        model = Dict()
    x = torch.randn(30)
    check_against_model(model, x, torch.tensor(2), "m:f")
    assert model.training
    with pytest.raises(DataError, match="label 3 of item 0 is outside the model's 3 classes"):
        check_against_model(model, x, torch.tensor(3), "m:f")
    with pytest.raises(DataError, match=r"token targets y \(5,\) need \(1, 5, vocab\)"):
        check_against_model(model, x, torch.zeros(5, dtype=torch.long), "m:f")
