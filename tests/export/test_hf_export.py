"""`tandem export --format hf`: checkpoints of tandem's Llama and GPT as Hugging Face folders that
transformers loads with no custom code (logits equal tandem.export.load's, greedy generate equals tandem's
greedy loop), streamed shards with an index and sha256s, the tokenizer carried; and the way back in
(model.name = "hf:DIR"): HF -> tandem -> HF is bit-exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from export.export_helpers import GPT, publish_checkpoint
from models.hf_models import make, transformers_or_skip
from tandem.core.config import load_spec
from tandem.core.errors import ConfigError
from tandem.export import export, load
from tandem_testing import ROOT

LLAMA = ROOT / "examples" / "llama_reverse.toml"
CASES = {
    "llama": (LLAMA, {}, "LlamaForCausalLM"),
    "llama-tied-qwen3": (LLAMA, {"tied": True, "qk_norm": True, "head_dim": 8, "norm_eps": 1e-6}, "Qwen3ForCausalLM"),
    "qwen2": (LLAMA, {"qkv_bias": True, "rope_theta": 1e6}, "Qwen2ForCausalLM"),
    "gpt-gqa-tied": (GPT, {}, "GPT2LMHeadModel"),
    "gpt-untied": (GPT, {"tied": False, "kv_heads": 4}, "GPT2LMHeadModel"),
}


def _run(tmp_path, case):
    path, over, _ = CASES[case]
    spec = load_spec(path, check=False)
    for k, v in over.items():
        setattr(spec.model, k, v)

    def jitter(sd):  # norms and biases off their initial 1 and 0
        g = torch.Generator().manual_seed(3)
        for k, v in sd.items():
            if v.dim() == 1 and v.is_floating_point():
                v.add_(0.1 * torch.randn(v.shape, generator=g))
    return publish_checkpoint(tmp_path / "run", spec, 3, jitter), spec


def greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """tandem's greedy loop (tandem/serve/generate.py's sample at temperature 0)."""
    from tandem.serve.generate import sample

    return torch.tensor(sample(model, ids[0].tolist(), n, model.config.seq, 0.0, 0))


QUICK = ("llama", "gpt-gqa-tied")   # the other cases (a few seconds each, most in transformers' generate): slow


@pytest.mark.parametrize("case", [c if c in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_transformers_loads_the_export(tmp_path, case):
    transformers = transformers_or_skip()
    run, spec = _run(tmp_path, case)
    r = export(run, tmp_path / "hf", format="hf")
    export(run, tmp_path / "tandem")
    assert r["architecture"] == CASES[case][2]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == [CASES[case][2]] and "model_type" in cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == CASES[case][2]
    ours = load(tmp_path / "tandem")
    x = torch.randint(0, spec.model.vocab, (2, spec.model.seq), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = ours(x), hf(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    prompt = x[:1, :4]
    n = spec.model.seq - 4
    with torch.no_grad():
        hf_ids = hf.generate(prompt, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0)[0, 4:]
    assert torch.equal(hf_ids, greedy(ours, prompt, n))
    man = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    assert man["tokenizer"]["hf"] is False and "reverse" in man["tokenizer"]["note"]
    assert set(man["files"]) >= {"config.json", "generation_config.json", "model.safetensors"}


def test_shards_index_and_sha256(tmp_path):
    from tandem.train.manifest import sha256

    run, _ = _run(tmp_path, "llama")
    r = export(run, tmp_path / "hf", format="hf", shard_size=40_000)
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    man = json.loads((out / "manifest.json").read_text())
    for f in files:
        assert man["files"][f]["sha256"] == sha256(out / f)
    assert index["metadata"]["total_size"] == sum(man["files"][f]["bytes"] for f in files) == r["bytes"]
    # tandem imports its own export back (the sha256s of the manifest checked on the way)
    from tandem.models import hf
    hf.load(out)
    data = bytearray((out / files[1]).read_bytes())
    data[-1] ^= 1
    (out / files[1]).write_bytes(bytes(data))
    with pytest.raises(ConfigError) as e:
        hf.load(out)
    assert f"{files[1]} differs from its sha256 in manifest.json" in str(e.value)


def test_tp_is_refused_with_format_hf(tmp_path):
    run, _ = _run(tmp_path, "gpt-gqa-tied")
    with pytest.raises(ConfigError) as e:
        export(run, tmp_path / "hf", format="hf", tp=2)
    assert e.value.field == "--tp" and "tandem's own format" in str(e.value)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "gpt2-gelu-new", "mistral",
                                  pytest.param("mixtral", marks=pytest.mark.slow)])
def test_round_trip_hf_tandem_hf_is_bit_exact(tmp_path, arch):
    """An HF folder imported (model.name = 'hf:DIR'), checkpointed as tandem's trainer does at step 0, exported
    back: every tensor's bytes equal the original's."""
    make(tmp_path / "orig", arch)
    spec = load_spec(None, {"model.name": f"hf:{tmp_path / 'orig'}", "data.name": "reverse"})
    from tandem.models import hf
    model = hf.load(tmp_path / "orig")

    def take(sd):
        sd.update({k: v.clone() for k, v in model.state_dict().items() if k in sd})
    run = publish_checkpoint(tmp_path / "run", spec, 0, take)
    r = export(run, tmp_path / "back", format="hf")
    a, b = load_file(tmp_path / "orig" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    tied = {"lm_head.weight"} if spec.model.tied else set()
    assert set(a) - tied == set(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    orig = json.loads((tmp_path / "orig" / "config.json").read_text())
    assert back["architectures"] == orig["architectures"] and r["architecture"] == orig["architectures"][0]
    assert back.get("bos_token_id") == orig.get("bos_token_id")


def _token_run(tmp_path, tokenizer: str):
    from tandem.data.text import prepare_text

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40 + "héllo wörld ✓\n")
    (src / "b.txt").write_text("pack my box with five dozen liquor jugs; " * 30)
    man = prepare_text([str(src)], tmp_path / "tok", globs=["*.txt"], tokenizer=tokenizer,
                       vocab=300 if tokenizer == "bpe" else 0, held_out=0.3)
    spec = load_spec(LLAMA, {"data.name": "tokens", "data.path": str(tmp_path / "tok"), "model.vocab":
                             str(man["vocab"])}, check=False)
    return publish_checkpoint(tmp_path / "run", spec, 1), spec


def test_the_bpe_tokenizer_is_carried_and_round_trips(tmp_path):
    transformers = transformers_or_skip()
    from tandem.data.text import Codec

    run, spec = _token_run(tmp_path, "bpe")
    r = export(run, tmp_path / "hf", format="hf")
    assert r["tokenizer"]["hf"] and {"tokenizer.json", "tokenizer_config.json"} <= set(r["files"])
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert type(tok).__name__ == "PreTrainedTokenizerFast" or "Tokenizers" in type(tok).__name__
    assert tok.chat_template is None    # prepare-text's BPE has none: none is made up
    codec = Codec(tmp_path / "tok")
    text = "the lazy fox, héllo ✓ jugs"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(codec.encode(text)) and tok.decode(ids) == text


def test_a_byte_level_folder_has_no_hf_tokenizer_and_says_so(tmp_path):
    run, _ = _token_run(tmp_path, "byte")
    r = export(run, tmp_path / "hf", format="hf")
    assert not r["tokenizer"]["hf"] and "no Hugging Face tokenizer" in r["tokenizer"]["note"]
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    man = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    assert man["tokenizer"]["kind"] == "byte"


def test_cli_format_hf(tmp_path, capsys):
    from export.export_helpers import cli

    run, _ = _run(tmp_path, "qwen2")
    code, out, err = cli(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")], capsys)
    assert code == 0, err
    assert "(Qwen2ForCausalLM, Hugging Face format)" in out and "no tokenizer: data.name = 'reverse'" in out
    code, out, err = cli(["export", str(run), "--format", "onnx"], capsys)
    assert code != 0 and "--format" in err and "use tandem or hf" in err
    code, out, err = cli(["export", str(run), "--format", "hf", "--tp", "2", "--out", str(tmp_path / "x")], capsys)
    assert code != 0 and "tandem's own format" in err and len(err.strip().splitlines()) == 1, err


def test_export_verify_of_an_hf_folder(tmp_path, capsys):
    from export.export_helpers import cli

    run, _ = _run(tmp_path, "gpt-gqa-tied")
    export(run, tmp_path / "hf", format="hf")
    code, out, err = cli(["export", "verify", str(tmp_path / "hf")], capsys)
    assert code == 0 and out.startswith("ok: ") and "[1, 16, 16]" in out, err
    cfg = tmp_path / "hf" / "config.json"
    cfg.write_text(cfg.read_text().replace('"n_layer": 2', '"n_layer": 3'))
    code, out, err = cli(["export", "verify", str(tmp_path / "hf")], capsys)
    assert code == 2 and "config.json is altered" in err, err


def test_build_model_of_an_hf_name_holds_its_weights(tmp_path):
    from models.hf_models import tokens
    from tandem.core.spec import ModelSpec
    from tandem.models import build_model

    ref = make(tmp_path, "llama")
    model = build_model(ModelSpec(name=f"hf:{tmp_path}", seq=8)).eval()
    assert model.config.seq == 8
    x = tokens(seq=8)
    with torch.no_grad():
        assert torch.allclose(model(x), ref(input_ids=x).logits, atol=1e-5, rtol=0)


def test_bf16_export_records_its_dtype(tmp_path):
    run, _ = _run(tmp_path, "llama")
    r = export(run, tmp_path / "hf", format="hf", dtype="bf16")
    assert r["max_cast_error"] > 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}
    from tandem.models import hf
    model = hf.load(tmp_path / "hf")        # tandem imports bf16 weights into its fp32 modules
    assert model.tok_emb.weight.dtype == torch.float32


MOE = ROOT / "examples" / "moe_reverse.toml"


@pytest.mark.slow
def test_a_trained_moe_run_exports_as_mixtral(tmp_path):
    """examples/moe_reverse.toml without its shared expert, trained 2 steps with its experts split over 2 ranks
    (ep 2: each rank's checkpoint shard holds half of every stacked expert weight), exported --format hf:
    transformers loads a MixtralForCausalLM whose logits equal tandem's own export's (tandem drops nothing in
    evaluation, Mixtral never does), and greedy generate gives tandem's tokens."""
    from tandem_testing import run_tandem

    transformers = transformers_or_skip()
    run = tmp_path / "run"
    r = run_tandem("train", str(MOE), "--model.shared_experts", "0", "--schedule.max_steps", "2",
                   "--data.num_samples", "256", "--launch.run_dir", str(run), "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    r = export(run, tmp_path / "hf", format="hf", shard_size=60_000)   # several shards: experts straddle them
    export(run, tmp_path / "tandem")
    assert r["architecture"] == "MixtralForCausalLM" and len([f for f in r["files"] if f.endswith("safetensors")]) > 1
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == \
        ("mixtral", 4, 2, 64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ours = load(tmp_path / "tandem")
    x = torch.randint(0, 16, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = ours(x), hf(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    with torch.no_grad():
        hf_ids = hf.generate(x[:1, :4], max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(hf_ids[0, 4:], greedy(ours, x[:1, :4], 12))
    # every expert's w1 is its slice of tandem's stacked (experts, hidden, ffn) weight, transposed
    from safetensors import safe_open
    from tandem.export.source import open_source
    stacked = open_source(run).read(["layers.1.mlp.experts.w1"])["layers.1.mlp.experts.w1"]
    name = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    with safe_open(str(tmp_path / "hf" / index["weight_map"][name]), framework="pt") as f:
        assert torch.equal(f.get_tensor(name), stacked[3].t())
    assert r["memory_budget_bytes"] == 4 * r["largest_tensor_bytes"] + 4 * stacked.numel() * stacked.element_size()


@pytest.mark.slow
def test_moe_exports_that_have_no_hf_class_are_refused_in_one_line(tmp_path):
    spec = load_spec(MOE, check=False)   # one shared expert: Qwen2-MoE would gate it, tandem does not
    run = publish_checkpoint(tmp_path / "run", spec, 1)
    with pytest.raises(ConfigError) as e:
        export(run, tmp_path / "hf", format="hf")
    text = str(e.value)
    assert "\n" not in text and e.value.field == "--format"
    assert "model.shared_experts 1 has no Hugging Face class" in text and "shared_expert_gate" in text
    assert not (tmp_path / "hf").exists()
    spec.model.shared_experts, spec.model.qk_norm = 0, True
    run = publish_checkpoint(tmp_path / "run2", spec, 1)
    with pytest.raises(ConfigError) as e:
        export(run, tmp_path / "hf", format="hf")
    assert "\n" not in str(e.value) and "model.qk_norm with model.experts has no Hugging Face class" in str(e.value)


def _moe_checkpoint(run, hidden: int, expert_ffn: int):
    """An MoE checkpoint of 6 blocks of 8 experts, written by a child process: this one stays small (a child
    started by fork counts the parent's resident pages in its own peak)."""
    import subprocess
    import sys

    code = f"""
import sys; sys.path[:0] = {[str(ROOT / "tests")]!r}
from pathlib import Path
from export.export_helpers import publish_checkpoint
from tandem.core.config import load_spec
spec = load_spec(Path({str(MOE)!r}), check=False)
m = spec.model
m.shared_experts, m.layers, m.experts, m.hidden, m.heads, m.kv_heads, m.expert_ffn, m.vocab = \\
    0, 6, 8, {hidden}, 8, 4, {expert_ffn}, 256
publish_checkpoint(Path({str(run)!r}), spec, 1)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return run


@pytest.mark.slow
def test_moe_hf_export_peak_memory_stays_within_its_budget(tmp_path):
    """A 600 MiB MoE checkpoint (6 blocks of 8 experts, each stacked weight 32 MiB) exported --format hf in a
    fresh process: its peak RSS (the kernel's, wait4) stays within the peak of the same export of a tiny model
    of the same shape + the summary's memory_budget_bytes + 64 MiB; loading the checkpoint whole would be
    far over it (the bound can fail)."""
    import os
    import subprocess
    import sys

    def peak(run, out) -> tuple[int, dict]:
        code = ("import json, sys; from tandem.export import export; "
                "print(json.dumps(export(sys.argv[1], sys.argv[2], format='hf')))")
        with open(tmp_path / "child.out", "w") as f, open(tmp_path / "child.err", "w") as e:
            p = subprocess.Popen([sys.executable, "-c", code, str(run), str(out)], stdout=f, stderr=e)
            _, status, usage = os.wait4(p.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, (tmp_path / "child.err").read_text()[-2000:]
        text = (tmp_path / "child.out").read_text()
        return usage.ru_maxrss * 1024, json.loads(text[text.index("{"):])

    tiny, big = _moe_checkpoint(tmp_path / "tiny", 32, 16), _moe_checkpoint(tmp_path / "big", 512, 2048)
    base, _ = peak(tiny, tmp_path / "tiny-hf")
    got, r = peak(big, tmp_path / "big-hf")
    mib = 1 << 20
    print(f"\ncheckpoint {r['bytes'] / mib:.0f} MiB: peak {got / mib:.0f} MiB, tiny model's {base / mib:.0f} MiB, "
          f"budget {r['memory_budget_bytes'] / mib:.0f} MiB, {r['seconds']:.1f} s")
    assert r["bytes"] > 2 * (r["memory_budget_bytes"] + 64 * mib)
    assert got <= base + r["memory_budget_bytes"] + 64 * mib, (got / mib, base / mib)
