"""The Llama decoder against a straightforward reference written here (one head, one position, one
feature pair at a time), against Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM when transformers
is installed, and its spec fields' one-line errors. No processes (the strategies' numerics:
tests/train/parallel/test_numerics.py)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from tandem.core.config import load_spec
from tandem.core.decoder import ffn_size
from tandem.core.errors import ConfigError
from tandem.core.spec import ModelSpec
from tandem.models import build_model, model_signature
from tandem.models.llama import Llama, LlamaConfig, inverse_frequencies
from tandem.train.parallel import pp
from tandem_testing import ROOT, skip_here_fail_in_ci

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 4}
CASES = {
    "llama-gqa": dict(kv_heads=2),
    "mha-tied": dict(kv_heads=0, tied=True),
    "llama3-scaling": dict(kv_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3),
    "linear-scaling": dict(kv_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": dict(kv_heads=2, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6),
    "qwen3": dict(kv_heads=2, qk_norm=True, head_dim=12, rope_theta=1e6, norm_eps=1e-6),
}


def tiny(**kw) -> Llama:
    torch.manual_seed(0)
    m = Llama(LlamaConfig(**{**dict(layers=2, hidden=32, heads=4, ffn=48, seq=12, vocab=20), **kw}))
    with torch.no_grad():  # norms and biases off their initial 1 and 0, so a wrong use of them shows
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    return m


def reference_frequencies(c: LlamaConfig) -> list[float]:
    """Hugging Face's _compute_llama3_parameters, written out per frequency."""
    d, s = c.head_dim, c.rope_scaling
    inv = [c.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    if s.get("rope_type") == "linear":
        return [f / s["factor"] for f in inv]
    if s.get("rope_type") != "llama3":
        return inv
    old, lo, hi, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                           s["factor"])
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def reference_logits(m: Llama, tokens: torch.Tensor) -> torch.Tensor:
    c, sd = m.config, m.state_dict()
    B, T = tokens.shape
    H, KV, d = c.heads, c.kv_heads, c.head_dim
    inv = reference_frequencies(c)

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    def linear(x, name):
        y = x @ sd[f"{name}.weight"].T
        return y + sd[f"{name}.bias"] if f"{name}.bias" in sd else y

    def rope(x):  # (B, T, heads, d): features i and i + d/2 turned by position t x frequency i
        out = x.clone()
        for t in range(T):
            for i in range(d // 2):
                cos, sin = math.cos(t * inv[i]), math.sin(t * inv[i])
                a, b = x[:, t, :, i], x[:, t, :, i + d // 2]
                out[:, t, :, i], out[:, t, :, i + d // 2] = a * cos - b * sin, a * sin + b * cos
        return out

    h = sd["tok_emb.weight"][tokens]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for n in range(c.layers):
        p = f"layers.{n}."
        x = rms(h, sd[p + "attn_norm.weight"])
        q = linear(x, p + "attn.wq").view(B, T, H, d)
        k = linear(x, p + "attn.wk").view(B, T, KV, d)
        v = linear(x, p + "attn.wv").view(B, T, KV, d)
        if c.qk_norm:
            q, k = rms(q, sd[p + "attn.q_norm.weight"]), rms(k, sd[p + "attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        heads = []
        for j in range(H):
            g = j // (H // KV)   # the key/value head query head j shares
            scores = (q[:, :, j] @ k[:, :, g].transpose(1, 2)) / math.sqrt(d)
            heads.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, :, g])
        h = h + linear(torch.cat(heads, dim=-1), p + "attn.wo")
        x = rms(h, sd[p + "mlp_norm.weight"])
        h = h + linear(F.silu(linear(x, p + "mlp.w1")) * linear(x, p + "mlp.w3"), p + "mlp.w2")
    return rms(h, sd["norm.weight"]) @ sd["head.weight"].T


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_the_reference(case):
    m = tiny(**CASES[case])
    tokens = torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = m(tokens), reference_logits(m, tokens)
    assert got.shape == (2, 12, 20)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()
    # shorter sequences take the first positions of the table (causal: a prefix's logits are the same)
    with torch.no_grad():
        assert torch.allclose(m(tokens[:, :5]), got[:, :5], atol=2e-5)


@pytest.mark.parametrize("case", ["llama3-scaling", "linear-scaling", "llama-gqa"])
def test_scaled_frequencies_are_hugging_faces(case):
    c = tiny(**CASES[case]).config
    assert torch.allclose(inverse_frequencies(c), torch.tensor(reference_frequencies(c), dtype=torch.float64),
                          rtol=1e-12)


def test_shapes_no_biases_untied_and_sizes_from_the_spec():
    ms = ModelSpec(name="llama", layers=3, hidden=64, heads=8, kv_heads=2, seq=16, vocab=32, tied=False)
    m = build_model(ms)
    sig = model_signature(m)
    assert sig["layers.0.attn.wq.weight"] == [64, 64] and sig["layers.0.attn.wk.weight"] == [16, 64]
    assert sig["layers.0.mlp.w1.weight"] == [256, 64] == [ffn_size(ms), 64]   # 8/3 x 64 = 170 -> 256
    assert not any(k.endswith("bias") for k in sig)
    assert m.head.weight is not m.tok_emb.weight and "rope.cache" not in m.state_dict()   # recomputed, not saved
    tied = build_model(ModelSpec(name="llama", layers=1, hidden=32, heads=4, seq=8, vocab=16, tied=True))
    assert tied.head.weight is tied.tok_emb.weight
    # Llama-2-7B's MLP from its hidden size, by the rule the 0 stands for
    assert ffn_size(ModelSpec(name="llama", hidden=4096)) == 11008


def test_pipeline_split_and_stage_skeleton_use_the_layout():
    m = tiny(layers=4, kv_heads=2)
    parts = pp.split_layers(m, 2, "even")
    assert parts == [[0, 1], [2, 3]]
    assert "stage 0: layers 0-1+emb" in pp.describe_split(m, parts)
    full = m(torch.zeros(1, 6, dtype=torch.long))
    first, last = pp.Chunk(m, parts[0], True, False), pp.Chunk(m, parts[1], False, True)
    with torch.no_grad():
        assert torch.allclose(last(first(torch.zeros(1, 6, dtype=torch.long))), full)
    pp.keep_only(m, parts, [1])
    assert m.tok_emb is None and list(m.layers) == ["2", "3"] and m.rope is not None


def _copy_into_hf(m: Llama, hf) -> None:
    names = {"tok_emb": "model.embed_tokens", "norm": "model.norm", "head": "lm_head", "attn_norm": "input_layernorm",
             "mlp_norm": "post_attention_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
             "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm",
             "attn.k_norm": "self_attn.k_norm", "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj",
             "mlp.w2": "mlp.down_proj"}
    sd = {}
    for k, v in m.state_dict().items():
        mod, _, attr = k.rpartition(".")
        if mod.startswith("layers."):
            _, n, rest = mod.split(".", 2)
            sd[f"model.layers.{n}.{names[rest]}.{attr}"] = v
        else:
            sd[f"{names[mod]}.{attr}"] = v
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing), (missing, unexpected)


@pytest.mark.parametrize("case", ["llama-gqa", "llama3-scaling", "qwen3", "mha-tied"])
def test_logits_match_hugging_face(case):
    try:
        import transformers
    except ImportError:
        skip_here_fail_in_ci("transformers is not installed (pip install transformers to compare with "
                             "Hugging Face's LlamaForCausalLM)", "the Hugging Face comparison")
    m = tiny(**CASES[case])
    c = m.config
    qwen3 = c.qk_norm
    cls_cfg = transformers.Qwen3Config if qwen3 else transformers.LlamaConfig
    kw = dict(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn, num_hidden_layers=c.layers,
              num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
              max_position_embeddings=c.seq, rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tied,
              attention_bias=c.qkv_bias)
    if "rope_parameters" in inspect.signature(cls_cfg.__init__).parameters:   # transformers >= 5
        kw["rope_parameters"] = {"rope_type": "default", **c.rope_scaling, "rope_theta": c.rope_theta}
    else:
        kw.update(rope_theta=c.rope_theta, rope_scaling=dict(c.rope_scaling) or None)
    cfg = cls_cfg(**kw)
    cfg._attn_implementation = "eager"
    hf = (transformers.Qwen3ForCausalLM if qwen3 else transformers.LlamaForCausalLM)(cfg).eval()
    _copy_into_hf(m, hf)
    tokens = torch.randint(0, c.vocab, (2, c.seq), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = hf(tokens).logits, m(tokens)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()


LLAMA_SPEC = str(ROOT / "examples" / "llama_reverse.toml")


@pytest.mark.parametrize("overrides,field,needle", [
    ({"model.heads": "4", "model.kv_heads": "3"}, "model.kv_heads", "heads 4 is not divisible by kv_heads 3"),
    ({"model.hidden": "60", "model.heads": "8"}, "model.heads", "hidden 60 is not divisible by heads 8"),
    ({"model.hidden": "24", "model.heads": "4"}, "model.heads", "head_dim 6"),   # even: fine
    ({"model.hidden": "20", "model.heads": "4"}, "model.heads", "head_dim 5 is odd"),
    ({"parallel.tp": "4", "launch.nproc_per_node": "4", "model.kv_heads": "2"}, "model.kv_heads",
     "kv_heads 2 is not divisible by tp 4"),
    ({"model.rope_theta": "0"}, "model.rope_theta", "rope_theta must be positive"),
    ({"model.norm_eps": "-1"}, "model.norm_eps", "norm_eps must be positive"),
    ({"model.rope_scaling": '{"rope_type": "yarn", "factor": 4}'}, "model.rope_scaling", "rope_type 'yarn'"),
    ({"model.rope_scaling": '{"rope_type": "llama3", "factr": 8}'}, "model.rope_scaling", "'factr' is not a llama3"),
    ({"model.rope_scaling": '{"rope_type": "linear"}'}, "model.rope_scaling", "linear rope_scaling needs 'factor'"),
    ({"model.rope_scaling": '{"rope_type": "llama3", "factor": 8, "low_freq_factor": 4}'}, "model.rope_scaling",
     "high_freq_factor 4.0 must exceed low_freq_factor 4.0"),
    ({"model.rope_scaling": "[1]"}, "model.rope_scaling", "expected dict"),
])
def test_bad_shapes_are_one_line_errors(overrides, field, needle):
    if needle == "head_dim 6":  # the control: an even head_dim builds
        load_spec(LLAMA_SPEC, overrides)
        return
    with pytest.raises(ConfigError) as e:
        load_spec(LLAMA_SPEC, overrides)
    assert e.value.field == field and needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rope_scaling_from_toml_and_the_command_line():
    s = load_spec(LLAMA_SPEC, {"model.rope_scaling": '{"rope_type": "llama3", "factor": 8}'})
    assert s.model.rope_scaling == {"rope_type": "llama3", "factor": 8}
    c = build_model(s.model).config
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("ms", [ModelSpec(name="gpt", layers=2, hidden=32, heads=4, seq=8, vocab=16),
                                ModelSpec(name="llama", layers=2, hidden=32, heads=4, seq=8, vocab=16, qk_norm=True)],
                         ids=["gpt", "llama"])
def test_every_name_a_layout_gives_is_a_module_of_the_model(ms):
    m = build_model(ms)
    lay = m.layout
    for name in (*lay.embeddings, *lay.shared, *lay.final, lay.blocks):
        m.get_submodule(name)
    block = getattr(m, lay.blocks)["0"]
    for name in (*lay.colwise, *lay.rowwise, *lay.norms, *lay.gathers, *lay.head_norms):
        block.get_submodule(name)
    assert bool(lay.head_norms) == (ms.name == "llama")
