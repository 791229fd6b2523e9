"""A language model on real text: prepare-text on a few standard-library modules, a short real train
whose held-out bits per byte falls below the order-0 byte entropy of the same text, and a sample."""

import json
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tandem_testing import run_script

SPEC = """
name = "lm"
[model]
name = "gpt"
layers = 1
hidden = 64
heads = 4
seq = 32
vocab = 256
[data]
name = "tokens"
path = "{data}"
num_samples = 256
[optim]
name = "adamw"
lr = 0.005
ref_batch = 0
weight_decay = 0.0
[schedule]
global_batch = 32
micro_batch = 16
max_steps = 120
warmup_steps = 5
[launch]
nproc_per_node = 2
run_dir = "{run}"
"""


def tandem(*args):
    return run_script(*args, timeout=600)   # prepare-text and a 120-step 2-rank GPT


@pytest.mark.slow
def test_gpt_on_stdlib_text_beats_order0_entropy_and_generates(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data, run = tmp_path / "tok", tmp_path / "run"
    r = tandem("data", "prepare-text", str(stdlib / "json"), str(stdlib / "email"), "--glob", "*.py",
               "--held-out", "0.1", "--out", str(data))
    assert r.returncode == 0, r.stderr
    assert f"wrote {data}: byte tokenizer, vocabulary 256, uint8 tokens" in r.stdout
    man = json.loads((data / "manifest.json").read_text())
    order0 = man["splits"]["held_out"]["order0_bits_per_byte"]
    spec = tmp_path / "lm.toml"
    spec.write_text(SPEC.format(data=data, run=run))
    r = tandem("train", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["order0_bits_per_byte"] == order0 and order0 > 4
    assert result["bits_per_byte"] < order0 - 0.3, (result["bits_per_byte"], order0)
    ev = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    ev = [e for e in ev if e["kind"] == "eval"]
    assert ev[-1]["bits_per_byte"] == result["bits_per_byte"]  # byte tokens: bits per byte = loss / ln 2
    assert abs(ev[-1]["held_out_loss"] / 0.6931471805599453 - ev[-1]["bits_per_byte"]) < 1e-9

    # The commands below only read the checkpoint (export writes beside it): each start-up is seconds
    # of imports, so they run side by side, the export folder's sample once the export is written.
    seeded = ("generate", str(run), "--prompt", "import ", "--tokens", "40", "--seed", "1")
    greedy = ("--prompt", "def ", "--tokens", "20", "--temperature", "0")
    with ThreadPoolExecutor(3) as pool:
        first, again, exported, nowhere, from_run = (pool.submit(tandem, *a) for a in [
            seeded, seeded, ("export", str(run)),
            ("generate", str(run), "--prompt", "x", "--data", str(tmp_path / "nowhere")),
            ("generate", str(run), *greedy)])
        # an export folder samples what its checkpoint samples
        assert exported.result().returncode == 0, exported.result().stderr
        from_export = tandem("generate", str(run / "export" / "step-00000120"), *greedy)
        first, again, nowhere, from_run = (f.result() for f in (first, again, nowhere, from_run))
    r = first
    assert r.returncode == 0, r.stderr
    head, text = r.stdout.split("\n", 1)
    assert head.startswith("# 40 tokens from ") and "step-00000120" in head
    assert text.startswith("import ") and len(text.encode()) >= 40
    assert again.stdout == r.stdout  # seeded
    assert from_run.returncode == from_export.returncode == 0, from_export.stderr
    assert from_run.stdout.split("\n", 1)[1] == from_export.stdout.split("\n", 1)[1]
    assert nowhere.returncode == 2 and nowhere.stderr.startswith("error: --data: not a token folder"), nowhere.stderr
