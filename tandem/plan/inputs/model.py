"""What the planner needs to know about a model: parameters, FLOPs, activations.

Three kinds:
- ``gpt``: a decoder-only transformer given its shape; parameters, FLOPs and
  activation memory come from closed formulas (Narayanan et al. 2021 for FLOPs,
  Korthikanti et al. 2022 for activations), generalised to GQA and gated MLPs.
- ``cnn``: measured numbers per sample (presets were measured once on the meta
  device with tandem.plan.inputs.measure; ``--model pkg.mod:factory`` measures yours).
- ``params``: only a parameter count; model states are exact, compute and
  activations are unknown unless given (the output says so).

**MoE** (``MoEShape``): the MLP of each MoE layer is ``experts`` routed experts of inner size
``expert_ffn`` (gated like the base shape) plus ``shared`` always-active ones and a router (h x experts);
the first ``dense_layers`` layers keep the base shape's dense MLP. Each token runs ``top_k`` routed
experts and the shared ones, so the FLOPs follow the active parameters. ``attn_params`` overrides the
attention block's parameter count per layer (multi-head latent attention, DeepSeek-V2/V3). How the
experts split over GPUs and route tokens: terms/expert.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
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
    # MoE (MoEShape, below): ``gpt`` is then the dense shape with the same FLOPs per layer
    # (the top_k + shared experts as one MLP), which FLOPs, stages and GEMMs follow; parameters,
    # memory and expert communication follow ``moe``
    moe: object = None

    @property
    def flops_per_sample(self) -> float | None:
        """Model FLOPs of one training sample (forward + backward = 3 x forward), no recompute."""
        if self.moe is not None:
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


# Measured once with tandem.plan.inputs.measure on the meta device (tests/plan re-measure them when
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


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
           tied: bool = False) -> dict:
    """A Llama-architecture decoder (SwiGLU, RMSNorm, rotary positions, no biases, no dropout)."""
    return dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq=seq,
                gated=True, bias=False, norm="rmsnorm", tied=tied, learned_pos=False, dropout=False)


# The models people plan today, each from its published Hugging Face config.json (num_hidden_layers, hidden_size,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings; rope_theta is in
# the source line: rotary positions hold no parameters and no FLOPs the planner counts). seq: the pre-training
# context the model's report gives (Llama 3: 8,192; Qwen2.5 / Qwen3: 4,096 before long-context stages; Mistral 7B:
# 8,192), --seq to change. Left out: Qwen2.5's q/k/v biases (3 x hidden numbers a layer, < 0.01% of the weights)
# and Qwen3's q/k RMSNorms (2 x 128 a layer); Qwen3 0.6B/4B/32B, whose query width heads x head_dim (128) is not
# hidden (GPTShape has head_dim = hidden / heads): give their config.json with those weights counted as GPTShape
# counts them, or the shape flags.
CURRENT_PRESETS = {
    "llama3-8b": (_llama(32, 4096, 32, 8, 14336, 128256, 8192), "meta-llama/Meta-Llama-3-8B", 500000),
    "llama3-70b": (_llama(80, 8192, 64, 8, 28672, 128256, 8192), "meta-llama/Meta-Llama-3-70B", 500000),
    "llama3.1-8b": (_llama(32, 4096, 32, 8, 14336, 128256, 8192), "meta-llama/Llama-3.1-8B", 500000),
    "llama3.1-70b": (_llama(80, 8192, 64, 8, 28672, 128256, 8192), "meta-llama/Llama-3.1-70B", 500000),
    "llama3.1-405b": (_llama(126, 16384, 128, 8, 53248, 128256, 8192), "meta-llama/Llama-3.1-405B", 500000),
    "llama3.2-1b": (_llama(16, 2048, 32, 8, 8192, 128256, 8192, tied=True), "meta-llama/Llama-3.2-1B", 500000),
    "llama3.2-3b": (_llama(28, 3072, 24, 8, 8192, 128256, 8192, tied=True), "meta-llama/Llama-3.2-3B", 500000),
    "llama3.3-70b": (_llama(80, 8192, 64, 8, 28672, 128256, 8192), "meta-llama/Llama-3.3-70B-Instruct", 500000),
    "qwen2.5-0.5b": (_llama(24, 896, 14, 2, 4864, 151936, 4096, tied=True), "Qwen/Qwen2.5-0.5B", 1000000),
    "qwen2.5-1.5b": (_llama(28, 1536, 12, 2, 8960, 151936, 4096, tied=True), "Qwen/Qwen2.5-1.5B", 1000000),
    "qwen2.5-3b": (_llama(36, 2048, 16, 2, 11008, 151936, 4096, tied=True), "Qwen/Qwen2.5-3B", 1000000),
    "qwen2.5-7b": (_llama(28, 3584, 28, 4, 18944, 152064, 4096), "Qwen/Qwen2.5-7B", 1000000),
    "qwen2.5-14b": (_llama(48, 5120, 40, 8, 13824, 152064, 4096), "Qwen/Qwen2.5-14B", 1000000),
    "qwen2.5-32b": (_llama(64, 5120, 40, 8, 27648, 152064, 4096), "Qwen/Qwen2.5-32B", 1000000),
    "qwen2.5-72b": (_llama(80, 8192, 64, 8, 29568, 152064, 4096), "Qwen/Qwen2.5-72B", 1000000),
    "qwen3-1.7b": (_llama(28, 2048, 16, 8, 6144, 151936, 4096, tied=True), "Qwen/Qwen3-1.7B-Base", 1000000),
    "qwen3-8b": (_llama(36, 4096, 32, 8, 12288, 151936, 4096), "Qwen/Qwen3-8B-Base", 1000000),
    "qwen3-14b": (_llama(40, 5120, 40, 8, 17408, 151936, 4096), "Qwen/Qwen3-14B-Base", 1000000),
    "mistral-7b": (_llama(32, 4096, 32, 8, 14336, 32000, 8192), "mistralai/Mistral-7B-v0.1", 10000),
}
GPT_PRESETS.update({k: shape for k, (shape, _, _) in CURRENT_PRESETS.items()})


def preset(name: str, seq: int | None = None) -> ModelStats:
    key = name.lower()
    if key in CNN_PRESETS:
        p = CNN_PRESETS[key]
        # In a ResNet the fc layer (2048 x 1000) is small; the largest conv block is ~2.4M (resnet50).
        return ModelStats(key, "cnn", p["params"], p["fwd"], p["act"], source="preset (measured on meta)",
                          largest_layer_params=2_359_296)
    if key in MOE_PRESETS:
        return moe_stats(MOE_PRESETS[key], key, seq)
    if key in GPT_PRESETS:
        kw = dict(GPT_PRESETS[key])
        if seq:
            kw["seq"] = seq
        src = "preset"
        if key in CURRENT_PRESETS:
            _, repo, theta = CURRENT_PRESETS[key]
            src = f"preset ({repo} config.json, rope_theta {theta:g})"
        return gpt_stats(GPTShape(**kw), name=key, source=src)
    raise ConfigError(f"unknown model '{name}'", field="model", value=name,
                      fix=f"use a preset ({', '.join(preset_names())}), or the model's Hugging Face config.json "
                          "(e.g. the config.json in huggingface.co/ORG/MODEL, or "
                          "~/.cache/huggingface/hub/models--ORG--MODEL/snapshots/*/config.json), gpt with "
                          "--layers --hidden --heads --vocab, --params N, or pkg.mod:factory")


def preset_names() -> list[str]:
    return list(CNN_PRESETS) + list(GPT_PRESETS) + list(MOE_PRESETS)


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


# ---- Mixture of experts


@dataclass(frozen=True)
class MoEShape:
    base: GPTShape
    experts: int
    top_k: int
    expert_ffn: int
    shared: int = 0
    dense_layers: int = 0
    capacity_factor: float = 1.0
    attn_params: int | None = None     # per layer, when attention is not GPTShape's (MLA)

    @property
    def moe_layers(self) -> int:
        return self.base.layers - self.dense_layers


def mlp_params(g: GPTShape, ffn: int) -> int:
    return (3 if g.gated else 2) * g.hidden * ffn + (((2 if g.gated else 1) * ffn + g.hidden) if g.bias else 0)


def attn_norm_params(m: MoEShape) -> int:
    g = m.base
    own = g.layer_params() - mlp_params(g, g.ffn)
    if m.attn_params is None:
        return own
    norms = 2 * (2 * g.hidden if g.norm == "layernorm" else g.hidden)
    return m.attn_params + norms


def _outside_layers(g: GPTShape) -> int:
    return g.params() - g.layers * g.layer_params()


def moe_params(m: MoEShape, active: bool = False) -> int:
    """All parameters, or (active) those one token uses: top_k routed experts + the shared ones."""
    g = m.base
    routed = m.top_k if active else m.experts
    moe = (routed + m.shared) * mlp_params(g, m.expert_ffn) + g.hidden * m.experts
    return (g.layers * attn_norm_params(m) + m.dense_layers * mlp_params(g, g.ffn) + m.moe_layers * moe
            + _outside_layers(g))


def expert_params(m: MoEShape) -> int:
    """Routed expert weights of the whole model: what expert parallelism splits."""
    return m.moe_layers * m.experts * mlp_params(m.base, m.expert_ffn)


def dense_layer_params(m: MoEShape) -> float:
    """Non-expert parameters of the mean layer (attention, norms, router, shared experts, dense MLPs)."""
    return (moe_params(m) - expert_params(m) - _outside_layers(m.base)) / m.base.layers


def fwd_flops_per_token(m: MoEShape) -> float:
    """2 FLOPs per multiply-add of the weight matrices a token uses (attention projections, top_k + shared
    experts, the router), attention scores 4 s h per layer and the logits, as GPTShape counts a dense model
    (norms and biases left out)."""
    g = m.base
    attn = m.attn_params if m.attn_params is not None else g.hidden * (g.hidden + 2 * g.kv_dim) + g.hidden * g.hidden
    mats = (3 if g.gated else 2) * g.hidden
    per_moe = (m.top_k + m.shared) * mats * m.expert_ffn + g.hidden * m.experts
    total = g.layers * attn + m.dense_layers * mats * g.ffn + m.moe_layers * per_moe
    return 2 * total + 4 * g.seq * g.hidden * g.layers + g.logits_fwd_flops_per_token()


def equivalent_shape(m: MoEShape) -> GPTShape:
    """The dense shape with an MoE layer's FLOPs per token: the top_k routed and the shared experts as one
    MLP of (top_k + shared) x expert_ffn (attention as GPTShape counts it; the router left out)."""
    return replace(m.base, ffn=m.expert_ffn * (m.top_k + m.shared))


def moe_stats(m: MoEShape, name: str = "moe", seq: int | None = None):
    if seq:
        m = replace(m, base=replace(m.base, seq=seq))
    g = m.base
    largest = max(attn_norm_params(m) + max(mlp_params(g, g.ffn) if m.dense_layers else 0,
                                             (m.experts + m.shared) * mlp_params(g, m.expert_ffn)),
                  g.vocab * g.hidden)
    return ModelStats(name, "gpt", moe_params(m), gpt=equivalent_shape(m), source="preset (MoE)",
                      largest_layer_params=largest, moe=m)


def mlp_act_coeff(m: MoEShape) -> float:
    """Korthikanti et al.'s MLP activation term per s x b x h (2-byte units) for an MoE layer: the layer's
    input and dropout mask (3) plus, per routed copy of a token (top_k x capacity factor) and per shared
    expert, its permuted input (2) and the expert's inner activations (4 x ffn/h, 6 gated)."""
    g = m.base
    inner = (6 if g.gated else 4) * m.expert_ffn / g.hidden
    return 3 + (m.top_k * m.capacity_factor + m.shared) * (2 + inner)


# Published MoE shapes (the sources' own figures in tests/plan/inputs/test_moe_shapes.py)
MIXTRAL_8X7B = MoEShape(GPTShape(layers=32, hidden=4096, heads=32, kv_heads=8, seq=4096, vocab=32000, ffn=14336,
                                 gated=True, bias=False, norm="rmsnorm", tied=False, learned_pos=False),
                        experts=8, top_k=2, expert_ffn=14336)


def _mla_params(h: int = 7168, heads: int = 128, q_rank: int = 1536, kv_rank: int = 512, nope: int = 128,
                rope: int = 64, v: int = 128) -> int:
    """Multi-head latent attention's weights per layer (DeepSeek-V2/V3), its low-rank norms included."""
    return (h * q_rank + q_rank + q_rank * heads * (nope + rope) + h * (kv_rank + rope) + kv_rank
            + kv_rank * heads * (nope + v) + heads * v * h)


DEEPSEEK_V3 = MoEShape(GPTShape(layers=61, hidden=7168, heads=128, seq=4096, vocab=129280, ffn=18432, gated=True,
                                bias=False, norm="rmsnorm", tied=False, learned_pos=False),
                       experts=256, top_k=8, expert_ffn=2048, shared=1, dense_layers=3, attn_params=_mla_params())


MOE_PRESETS = {"mixtral-8x7b": MIXTRAL_8X7B, "deepseek-v3": DEEPSEEK_V3}
