"""What the planner needs to know about a model: parameters, FLOPs, activations.

Three kinds:
- ``gpt``: a decoder-only transformer given its shape; parameters, FLOPs and
  activation memory come from closed formulas (Narayanan et al. 2021 for FLOPs,
  Korthikanti et al. 2022 for activations), generalised to GQA and gated MLPs.
- ``cnn``: measured numbers per sample (presets were measured once on the meta
  device with tandem.plan.measure; ``--model pkg.mod:factory`` measures yours).
- ``params``: only a parameter count; model states are exact, compute and
  activations are unknown unless given (the output says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.core.errors import ConfigError


@dataclass(frozen=True)   # a value (hashable): the cost model caches per-shape arithmetic on it
class GPTShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    kv_heads: int = 0        # 0: same as heads (multi-head attention)
    ffn: int = 0             # 0: 4 * hidden
    gated: bool = False      # SwiGLU-style MLP with three matrices (LLaMA)
    bias: bool = True        # Megatron GPT has biases; LLaMA has none
    norm: str = "layernorm"  # layernorm (weight+bias) | rmsnorm (weight)
    tied: bool = True        # output layer shares the embedding matrix
    learned_pos: bool = True # learned position embeddings (GPT-2/3, Megatron) vs rotary
    dropout: bool = True     # trained with dropout (its masks are activations); Llama 3 and torchtitan: none

    def __post_init__(self):
        for k in ("layers", "hidden", "heads", "seq", "vocab"):
            v = getattr(self, k)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError("must be a positive integer", field=k, value=v, fix=f"give --{k} >= 1")
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.kv_heads < 0 or self.ffn < 0:
            raise ConfigError("must be positive", field="kv-heads/ffn", value=(self.kv_heads, self.ffn),
                              fix="give positive sizes")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads}", field="heads",
                              value=self.heads, fix="choose heads that divide hidden")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads {self.heads} not divisible by kv-heads {self.kv_heads}",
                              field="kv-heads", value=self.kv_heads, fix="choose kv-heads that divide heads")

    @property
    def kv_dim(self) -> int:
        return self.hidden * self.kv_heads // self.heads

    def layer_params(self) -> int:
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        attn = h * (h + 2 * kv) + h * h + ((h + 2 * kv) + h if self.bias else 0)
        mlp = (3 if self.gated else 2) * h * f + (((2 if self.gated else 1) * f + h) if self.bias else 0)
        norms = 2 * (2 * h if self.norm == "layernorm" else h)
        return attn + mlp + norms

    def params(self) -> int:
        h = self.hidden
        emb = self.vocab * h * (1 if self.tied else 2) + (self.seq * h if self.learned_pos else 0)
        final_norm = 2 * h if self.norm == "layernorm" else h
        return self.layers * self.layer_params() + emb + final_norm

    def layer_fwd_flops_per_token(self) -> float:
        """2 FLOPs per multiply-add: projections plus attention scores (QK^T and AV over the
        full s x s square, as Megatron counts; causal kernels skip about half of it)."""
        h, f, kv, s = self.hidden, self.ffn, self.kv_dim, self.seq
        proj = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * (3 if self.gated else 2) * h * f
        return proj + 4 * s * h

    def logits_fwd_flops_per_token(self) -> float:
        return 2 * self.hidden * self.vocab

    def attn_score_fwd_flops_per_token(self) -> float:
        return 4 * self.seq * self.hidden


SELECTIVE_FACTOR = 3   # selective recompute costs 3 x the attention core's forward FLOPs (see above)


@dataclass
class ModelStats:
    name: str
    kind: str                          # gpt | cnn | params
    params: int
    fwd_flops_per_sample: float | None = None   # None: unknown
    act_bytes_per_sample_fp32: float | None = None  # cnn: saved-for-backward bytes at fp32
    gpt: GPTShape | None = None
    source: str = ""
    largest_layer_params: int = 0
    # MoE (tandem.plan.moe_cp.MoEShape): ``gpt`` is then the dense shape with the same FLOPs per layer
    # (the top_k + shared experts as one MLP), which FLOPs, stages and GEMMs follow; parameters,
    # memory and expert communication follow ``moe``
    moe: object = None

    @property
    def flops_per_sample(self) -> float | None:
        """Model FLOPs of one training sample (forward + backward = 3 x forward), no recompute."""
        if self.moe is not None:
            from tandem.plan.moe_cp import fwd_flops_per_token

            return 3 * self.gpt.seq * fwd_flops_per_token(self.moe)
        if self.gpt is not None:
            g = self.gpt
            return 3 * g.seq * (g.layers * g.layer_fwd_flops_per_token() + g.logits_fwd_flops_per_token())
        return None if self.fwd_flops_per_sample is None else 3 * self.fwd_flops_per_sample

    def recompute_flops_per_sample(self, recompute: str) -> float:
        """Extra FLOPs of activation recompute (hardware FLOPs minus model FLOPs)."""
        if recompute == "none":
            return 0.0
        if self.gpt is not None:
            g = self.gpt
            # selective: 3 x the attention core's forward (12*s*h per token per layer), as Korthikanti et al.
            # 2022 count it: hardware FLOPs 72*B*s*l*h^2*(1 + s/3h + V/12lh) against model FLOPs (1 + s/6h + ...)
            per_tok = (g.layer_fwd_flops_per_token() if recompute == "full"
                       else SELECTIVE_FACTOR * g.attn_score_fwd_flops_per_token())
            return g.seq * g.layers * per_tok
        fwd = self.fwd_flops_per_sample or 0.0
        return fwd if recompute == "full" else 0.0


# Measured once with tandem.plan.measure on the meta device (tests/plan re-measure them when
# tandem.models is importable): parameters exact, FLOPs from torch's FlopCounterMode at 224 px,
# activations = bytes of tensors autograd saves for backward, fp32, per sample.
CNN_PRESETS = {
    "resnet18": dict(params=11_689_512, fwd=3_628_146_688, act=22_218_240),
    "resnet50": dict(params=25_557_032, fwd=8_178_368_512, act=86_121_984),
}

# GPT presets: Megatron-LM's GPT-3 style shapes (Narayanan et al. 2021, Table 1) and LLaMA-2.
GPT_PRESETS = {
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200),
    "gpt-1t": dict(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200),
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, ffn=11008, gated=True,
                      bias=False, norm="rmsnorm", tied=False, learned_pos=False),
    "llama2-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, seq=4096, vocab=32000, ffn=28672,
                       gated=True, bias=False, norm="rmsnorm", tied=False, learned_pos=False),
}


def preset(name: str, seq: int | None = None) -> ModelStats:
    key = name.lower()
    if key in CNN_PRESETS:
        p = CNN_PRESETS[key]
        # In a ResNet the fc layer (2048 x 1000) is small; the largest conv block is ~2.4M (resnet50).
        return ModelStats(key, "cnn", p["params"], p["fwd"], p["act"], source="preset (measured on meta)",
                          largest_layer_params=2_359_296)
    from tandem.plan.moe_cp import MOE_PRESETS, moe_stats

    if key in MOE_PRESETS:
        return moe_stats(MOE_PRESETS[key], key, seq)
    if key in GPT_PRESETS:
        kw = dict(GPT_PRESETS[key])
        if seq:
            kw["seq"] = seq
        return gpt_stats(GPTShape(**kw), name=key, source="preset")
    raise ConfigError(f"unknown model '{name}'", field="model", value=name,
                      fix=f"use one of {', '.join(list(CNN_PRESETS) + list(GPT_PRESETS) + list(MOE_PRESETS))}, "
                          "gpt (with --layers --hidden ...), --params N, an HF config.json, or pkg.mod:factory")


def gpt_stats(shape: GPTShape, name: str = "gpt", source: str = "formula") -> ModelStats:
    g = shape
    biggest = max(g.layer_params(), g.vocab * g.hidden)
    return ModelStats(name, "gpt", g.params(), gpt=g, source=source, largest_layer_params=biggest)


def params_only(n: float) -> ModelStats:
    if not n or n <= 0:
        raise ConfigError("must be positive", field="params", value=n, fix="give --params like 7e9")
    return ModelStats(f"{n:.3g} params", "params", int(n), source="--params (model states only)",
                      largest_layer_params=0)


def from_hf_config(path: str | Path, seq: int | None = None) -> ModelStats:
    """A Hugging Face config.json of a GPT-2 / LLaMA / Mistral / Qwen-style decoder."""
    p = Path(path)
    try:
        c = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read HF config ({e})", field="model", value=str(p),
                          fix="give a config.json of a decoder-only model") from None
    get = lambda *ks, default=None: next((c[k] for k in ks if k in c), default)  # noqa: E731
    h = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    vocab = get("vocab_size")
    if None in (h, layers, heads, vocab):
        raise ConfigError("not a decoder config: needs hidden_size, num_hidden_layers, num_attention_heads, "
                          "vocab_size", field="model", value=str(p), fix="give a GPT/LLaMA-style config.json")
    gpt2 = c.get("model_type") == "gpt2" or "n_embd" in c
    llama_like = "intermediate_size" in c and c.get("hidden_act", "silu") in ("silu", "swiglu")
    shape = GPTShape(
        layers=layers, hidden=h, heads=heads, vocab=vocab,
        seq=seq or get("max_position_embeddings", "n_positions", default=2048),
        kv_heads=get("num_key_value_heads", default=heads) or heads,
        ffn=get("intermediate_size", "n_inner", default=None) or 4 * h,
        gated=llama_like, bias=gpt2 or bool(c.get("attention_bias", False)) and not llama_like,
        norm="layernorm" if gpt2 else "rmsnorm", tied=bool(c.get("tie_word_embeddings", gpt2)),
        learned_pos=gpt2)
    return gpt_stats(shape, name=c.get("_name_or_path") or p.stem, source=f"HF config {p.name}")
