"""Fine-tune a Hugging Face checkpoint (model.name = "hf:DIR", made here with from_config + save_pretrained)
with real 2-rank `tandem train` runs under ddp, zero1, zero3, tp 2 and pp 2 (and dp 2 x tp 2 on 4 ranks), then `tandem export --format hf`:
transformers loads the export, its logits equal tandem's within 1e-5, greedy generate gives tandem's
tokens. The learning rate is small enough (AdamW moves each weight by about lr a step) that the exported
weights must sit within a few lr of the original's: a run whose shards started from tandem's random init
instead of the checkpoint's tensors, or from a wrongly cut piece of them, is off by orders more."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from models.hf_models import make, transformers_or_skip
from tandem_testing import run_tandem

LR = 1e-6
SPEC = """
name = "hf-finetune"
[model]
name = "hf:{folder}"
[data]
name = "reverse"
num_samples = 256
held_out = 0
[optim]
name = "adamw"
lr = {lr}
ref_batch = 0
weight_decay = 0.0
[schedule]
global_batch = 16
micro_batch = 8
max_steps = 2
log_every = 1
[launch]
nproc_per_node = 2
run_dir = "{run}"
"""
LAYOUTS = {"ddp": [], "zero1": ["--parallel.strategy", "zero1"], "zero3": ["--parallel.strategy", "zero3"],
           "tp2": ["--parallel.tp", "2"],
           "pp2": ["--parallel.pp", "2"],
           "ep2": ["--parallel.ep", "2"],   # Mixtral: each rank holds 2 of the 4 experts, read from its shards
           # dp 2 x tp 2 on 4 ranks, the dp dimension sharded by FSDP2 (zero2): 2D in one run
           "dp2xtp2-zero2": ["--parallel.tp", "2", "--parallel.strategy", "zero2", "--schedule.micro_batch", "4",
                             "--launch.nproc_per_node", "4"]}


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [("llama", "ddp"), ("qwen3", "zero3"), ("llama", "tp2"), ("qwen2", "pp2"),
                                         ("gpt2", "zero3"), ("mistral", "zero1"),
                                         ("qwen3", "dp2xtp2-zero2"), ("mixtral", "ep2")])
def test_finetune_from_an_hf_folder_and_export_it_back(tmp_path, arch, layout):
    transformers = transformers_or_skip()
    make(tmp_path / "base", arch)
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(folder=tmp_path / "base", lr=LR, run=tmp_path / "run"))
    r = run_tandem("train", str(spec), *LAYOUTS[layout], "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_tandem("export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"), "--json",
                   timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    base, out = load_file(tmp_path / "base" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(out) == set(base) - ({"lm_head.weight"} if arch == "gpt2" else set())
    moved = max((out[k] - base[k]).abs().max().item() for k in out)
    assert 0 < moved < 5 * LR, moved   # trained (2 steps), and from the checkpoint's own weights on every shard

    from tandem import export
    export.export(tmp_path / "run", tmp_path / "tandem")
    ours = export.load(tmp_path / "tandem")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=x).logits, ours(x), atol=1e-5, rtol=0)
        hf_ids = hf.generate(x[:1, :4], max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    from tandem.serve.generate import sample
    assert hf_ids[0, 4:].tolist() == sample(ours, x[0, :4].tolist(), 12, 16, 0.0, 0)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == \
        json.loads((tmp_path / "base" / "config.json").read_text())["architectures"]
    if layout == "ddp":  # the same spec again resumes the run's checkpoint (step 2) instead of the hf: weights
        r = run_tandem("train", str(spec), "--schedule.max_steps", "3", "--json", timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout[r.stdout.index("{"):])["step"] == 3
        assert (tmp_path / "run" / "checkpoints" / "step-00000003").is_dir()


@pytest.mark.slow
def test_the_first_step_loss_is_transformers_loss_with_labels(tmp_path):
    """2-rank zero3 on a byte token folder, unshuffled: step 1's batch is windows 0..7 (17 tokens each) and its
    loss is computed with the imported weights. transformers' loss(input_ids=w, labels=w) scores logits of
    positions 0..15 against w[1:17] (it shifts inside), which is what tandem's token windows give the model
    already shifted (x = w[:16], y = w[1:17]): the same number."""
    transformers = transformers_or_skip()
    from tandem.data.text import prepare_text

    hf_model = make(tmp_path / "base", "llama", vocab_size=256, initializer_range=0.3)   # a loss far from ln 256
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("".join(f"line {i}: the quick brown fox {i * i}\n" for i in range(60)))
    prepare_text([str(src)], tmp_path / "tok", globs=["*.txt"], held_out=0.0)
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(folder=tmp_path / "base", lr=LR, run=tmp_path / "run")
                    .replace('name = "reverse"\nnum_samples = 256', f'name = "tokens"\npath = "{tmp_path / "tok"}"'
                             f'\nshuffle = false')
                    .replace("global_batch = 16\nmicro_batch = 8\nmax_steps = 2",
                             "global_batch = 8\nmicro_batch = 4\nmax_steps = 1"))
    r = run_tandem("train", str(spec), "--parallel.strategy", "zero3", "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    from tandem.core.rundir import read_metrics
    step1 = next(m for m in read_metrics(tmp_path / "run") if m.get("step") == 1 and "loss" in m)
    import numpy as np
    tokens = np.fromfile(tmp_path / "tok" / "train.bin", dtype=np.uint8).astype(np.int64)
    w = torch.from_numpy(np.stack([tokens[i * 16: i * 16 + 17] for i in range(8)]))
    with torch.no_grad():
        want = hf_model(input_ids=w, labels=w).loss.item()
    print("step-1 loss", step1["loss"], "transformers", want)
    assert abs(step1["loss"] - want) < 1e-5 * max(1.0, want), (step1["loss"], want)
