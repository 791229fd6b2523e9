"""``model.name = "hf:DIR"``: a Hugging Face checkpoint made here (tests/models/hf_models.py) loaded into
tandem's own Llama / GPT through the adapters (tandem/core/hf.py, tandem/models/hf.py): the logits and the
loss equal transformers', and every bad folder is one line naming what is wrong. No processes (the
strategies: tests/export/test_hf_export.py)."""

from __future__ import annotations

import json

import pytest
import torch

from models.hf_models import ARCHS, SEQ, make, tokens
from tandem.core.config import load_spec
from tandem.core.errors import ConfigError
from tandem.models import build_model, hf



@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_loss_equal_transformers(tmp_path, arch):
    ref = make(tmp_path, arch)
    model = hf.load(tmp_path)
    x = tokens()
    with torch.no_grad():
        want = ref(input_ids=x)
        got = model(x)
    assert got.shape == want.logits.shape
    assert torch.allclose(got, want.logits, atol=1e-5, rtol=0), (got - want.logits).abs().max()
    # transformers shifts inside: loss(labels=x) scores logits[:, :-1] against x[:, 1:]. tandem's token tasks
    # hand the model x[:, :-1] and the targets x[:, 1:] already shifted, and sum (the trainer divides by the
    # number of scored targets): the same number
    from tandem.train.parallel import loss_sum
    with torch.no_grad():
        hf_loss = ref(input_ids=x, labels=x).loss
        tandem_loss = loss_sum(model(x[:, :-1]), x[:, 1:]) / x[:, 1:].numel()
    assert abs(hf_loss.item() - tandem_loss.item()) < 1e-5, (hf_loss.item(), tandem_loss.item())


def test_spec_fields_from_config_json(tmp_path):
    make(tmp_path, "qwen3")
    s = load_spec(None, {"model.name": f"hf:{tmp_path}", "data.name": "reverse", "model.seq": "12"})
    m = s.model
    assert (m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.head_dim, m.vocab, m.seq) == \
        ("llama", 2, 32, 4, 2, 48, 12, 40, 12)
    assert m.qk_norm and not m.qkv_bias and m.rope_theta == 1e6 and m.norm_eps == 1e-6 and not m.tied
    assert m.hf["architecture"] == "Qwen3ForCausalLM" and m.hf["path"] == str(tmp_path.resolve())
    # spec.json round trip: the resolved spec loads as it is (name llama, hf kept)
    from tandem.core.config import from_dict, to_dict
    assert from_dict(json.loads(json.dumps(to_dict(s)))).model == m


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_not_an_hf_folder(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path}"})
    assert "is not a Hugging Face model folder (no config.json)" in _one_line(e) and e.value.field == "model.name"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **json.loads(
        json.dumps({"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                    "num_attention_heads": 2}))}))
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path}"})
    assert "has no model.safetensors nor model.safetensors.index.json" in _one_line(e)


@pytest.mark.parametrize("arch,msg", [("BertForMaskedLM", "architecture BertForMaskedLM is not supported")])
def test_unsupported_architecture(tmp_path, arch, msg):
    make(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path}"})
    assert msg in _one_line(e)


@pytest.mark.parametrize("arch,key,value", [("llama", "attention_dropout", 0.1), ("llama", "hidden_act", "gelu"),
                                            ("llama", "mlp_bias", True), ("llama", "attention_bias", True),
                                            ("mistral", "sliding_window", 8), ("qwen2", "use_sliding_window", True),
                                            ("gpt2", "activation_function", "relu"),
                                            ("qwen3", "rope_parameters", {"full_attention": {"rope_theta": 1e6},
                                                                          "sliding_attention": {"rope_theta": 1e4}}),
                                            ("gpt2", "attn_pdrop", 0.1)])
def test_a_config_key_tandem_would_ignore_is_named(tmp_path, arch, key, value):
    make(tmp_path, arch)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path}"})
    assert f"config.json: {key} = {json.dumps(value)}" in _one_line(e)


def test_mistral_window_at_least_seq_is_fine(tmp_path):
    make(tmp_path, "mistral", sliding_window=SEQ)
    assert load_spec(None, {"model.name": f"hf:{tmp_path}"}).model.hf["architecture"] == "MistralForCausalLM"


def _sharded(tmp_path):
    ref = make(tmp_path / "m", "llama")
    ref.save_pretrained(str(tmp_path / "m"), max_shard_size="20KB")
    (tmp_path / "m" / "model.safetensors").unlink(missing_ok=True)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    return tmp_path / "m", index


def test_a_sharded_folder_loads_and_a_missing_shard_is_named(tmp_path):
    folder, index = _sharded(tmp_path)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    hf.load(folder)
    (folder / files[1]).unlink()
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{folder}"})
    assert f"shard {files[1]} is missing" in _one_line(e)


def test_a_shard_whose_shape_disagrees_with_config_json(tmp_path):
    make(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path}"})
    assert "model.layers.0.mlp.gate_proj.weight in model.safetensors is [48, 32], config.json implies [64, 32]" \
        in _one_line(e)


def test_a_shape_field_that_disagrees_with_config_json(tmp_path):
    make(tmp_path, "llama")
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path}", "model.hidden": "64"})
    assert e.value.field == "model.hidden" and "config.json gives 32" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path}", "model.seq": "32"})
    assert e.value.field == "model.seq" and "exceeds the checkpoint's max_position_embeddings 16" in _one_line(e)
    make(tmp_path / "g", "gpt2")
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path / 'g'}", "model.seq": "8"})
    assert "differs from n_positions 16" in _one_line(e)


def test_build_model_of_a_resolved_spec_is_a_fresh_init_the_materializer_fills(tmp_path):
    """build_model of the resolved spec (name llama, hf set) is tandem's seeded init; the materializer with the
    folder's weights gives the checkpoint's values: the training path."""
    ref = make(tmp_path, "qwen2")
    s = load_spec(None, {"model.name": f"hf:{tmp_path}"})
    from tandem.train.parallel.materialize import Materializer, build_meta
    meta = build_meta(s.model, torch.device("cpu"))
    assert all(p.is_meta for p in meta.parameters())
    Materializer(0, torch.device("cpu"), hf.weights_for(s.model))(meta)
    x = tokens()
    with torch.no_grad():
        assert torch.allclose(meta(x), ref(input_ids=x).logits, atol=1e-5, rtol=0)


def test_a_tensor_tandem_has_no_place_for_is_named(tmp_path):
    """A Qwen2 checkpoint (q/k/v biases) whose config.json says Llama: the biases would be dropped."""
    make(tmp_path, "qwen2")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"}))
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path}"})
    assert "holds tensor model.layers.0.self_attn.k_proj.bias (model.safetensors) that tandem's model" in _one_line(e)
    assert "(and 5 more)" in str(e.value)


def test_build_meta_of_an_unresolved_hf_name_is_filled_by_its_weights(tmp_path):
    """A ModelSpec made in Python (name 'hf:DIR', not through load_spec): build_meta gives the meta model and
    weights_for the folder's reader, so the materializer fills it with the checkpoint, not an init."""
    from tandem.core.spec import ModelSpec
    from tandem.train.parallel.materialize import Materializer, build_meta

    ref = make(tmp_path, "gpt2")
    ms = ModelSpec(name=f"hf:{tmp_path}")
    meta = build_meta(ms, torch.device("cpu"))
    assert all(p.is_meta for p in meta.parameters())
    Materializer(0, torch.device("cpu"), hf.weights_for(ms))(meta)
    x = tokens()
    with torch.no_grad():
        assert torch.allclose(meta(x), ref(input_ids=x).logits, atol=1e-5, rtol=0)


def test_gelu_is_a_checked_choice():
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": "gpt", "model.gelu": "fast", "data.name": "reverse"})
    assert e.value.field == "model.gelu" and "'fast' is not one of exact, tanh" in _one_line(e)


@pytest.mark.slow
def test_mixtral_spec_fields_and_its_refusals(tmp_path):
    """A Mixtral folder is tandem's MoE Llama (experts, top_k, expert_ffn from config.json, no shared experts);
    router noise tandem does not add, or experts asked of a dense checkpoint, are one line each."""
    make(tmp_path / "mx", "mixtral")
    m = load_spec(None, {"model.name": f"hf:{tmp_path / 'mx'}", "data.name": "reverse"}).model
    assert (m.name, m.experts, m.top_k, m.shared_experts, m.expert_ffn, m.ffn) == ("llama", 4, 2, 0, 48, 48)
    assert m.hf["architecture"] == "MixtralForCausalLM"
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path / 'mx'}", "model.shared_experts": "1"})
    assert "model.shared_experts = '1' but" in _one_line(e) and "gives 0" in _one_line(e)
    assert load_spec(None, {"model.name": f"hf:{tmp_path / 'mx'}", "model.experts": "4"}).model.experts == 4
    cfg = json.loads((tmp_path / "mx" / "config.json").read_text())
    (tmp_path / "mx" / "config.json").write_text(json.dumps({**cfg, "router_jitter_noise": 0.1}))
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path / 'mx'}"})
    assert "router_jitter_noise = 0.1: tandem's router adds no noise" in _one_line(e)
    make(tmp_path / "dense", "llama")
    with pytest.raises(ConfigError) as e:
        load_spec(None, {"model.name": f"hf:{tmp_path / 'dense'}", "model.experts": "4"})
    assert "is a dense LlamaForCausalLM" in _one_line(e) and e.value.field == "model.experts"
    assert load_spec(None, {"model.name": f"hf:{tmp_path / 'dense'}", "model.experts": "0"}).model.experts == 0
