"""Hugging Face checkpoints: the adapters between a ``transformers`` config.json / state dict and tandem's
own decoders, as data (no torch here, so a spec naming ``hf:DIR`` is checked before any process starts).

    arch = for_config(json.load(open("DIR/config.json")))   # LlamaForCausalLM -> LLAMA, ...
    fields = arch.fields(cfg)                               # ModelSpec fields: name "llama", hidden, heads, ...
    rules = arch.rules(model)                               # tensor by tensor: HF name, tandem names, shape, op
    cfg = arch.config(model)                                # the other way: config.json for an export

One adapter per architecture (``ARCHITECTURES``). The Llama family (Llama, Qwen2, Qwen3, Mistral) maps one
tensor to one tensor with the same layout (tandem's rotation is Hugging Face's ``rotate_half``, so q/k load
unpermuted); Mixtral is tandem's MoE Llama without shared experts (each expert one HF tensor per linear,
a slice of tandem's stacked expert weights); GPT-2 stores its linears as ``Conv1D`` (weight transposed,
in x out) and fuses q, k, v into one ``c_attn`` (tandem's grouped k/v heads are repeated into it on the way
out). A config key whose value tandem would silently compute differently (a bias tandem has no place for,
dropout, another activation, a sliding window, router noise) is one ConfigError naming the key. The torch side (reading,
transforming, writing tensors) is ``tandem/models/hf.py``.

``resolve(data)`` turns a [model] table whose name is ``hf:DIR`` into tandem's own model (``name = "llama"``
or ``"gpt"``, the shape fields from config.json) and ``hf = {path, architecture, config}``, after checking the
folder: config.json, the safetensors files the index names, every tensor's shape in their headers.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from tandem.core.errors import ConfigError

PREFIX = "hf:"
FIELD = "model.name"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# ModelSpec fields config.json decides (a [model] table may repeat them only with the same value)
SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "head_dim", "vocab", "tied", "rope_theta",
                "rope_scaling", "norm_eps", "qkv_bias", "qk_norm", "gelu", "experts", "top_k", "shared_experts",
                "expert_ffn")


def is_hf(name) -> bool:
    return str(name or "").startswith(PREFIX)


@dataclass(frozen=True)
class Rule:
    """One Hugging Face tensor and the tandem tensor(s) it holds.

    op: ``copy`` (same layout), ``transpose`` (GPT-2's Conv1D: HF weight = tandem weight.T), ``qkv`` (GPT-2's
    c_attn weight: [wq; wk; wv].T with each k/v head repeated ``repeat`` times), ``qkv_bias`` (its bias),
    ``expert`` (Mixtral's per-expert linear: HF weight = tandem's stacked (experts, in, out) tensor[expert].T;
    one tandem tensor is ``experts`` HF tensors)."""
    hf: str
    tandem: tuple[str, ...]
    shape: tuple[int, ...]
    op: str = "copy"
    repeat: int = 1
    expert: int = -1


def _bad(key: str, value, why: str, fix: str, folder: str = "") -> ConfigError:
    where = f"{folder}/config.json: " if folder else "config.json: "
    return ConfigError(f"{where}{key} = {json.dumps(value)}: {why}", field=FIELD,
                       value=f"{PREFIX}{folder}" if folder else key, fix=fix)


def _get(cfg: dict, key: str, default=None, folder: str = ""):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is None:
        raise ConfigError(f"{folder or '.'}/config.json has no {key!r}", field=FIELD, value=f"{PREFIX}{folder}",
                          fix=f"give {key} in config.json (a transformers save_pretrained writes it)")
    return default


@dataclass(frozen=True)
class LlamaFamily:
    """LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, MixtralForCausalLM onto
    tandem's Llama.

    Mixtral (``moe``) is tandem's MoE Llama without shared experts: its router (``block_sparse_moe.gate``)
    takes the softmax of the logits, the top ``num_experts_per_tok`` and renormalises them to sum to 1, as
    tandem's (tandem/models/moe.py ``route``); each expert is a SwiGLU ``w2(silu(w1 x) * w3 x)`` stored per
    expert (``experts.E.w1.weight`` (ffn, h)), tandem's stacked (experts, h, ffn) transposed. Mixtral has no
    capacity: tandem drops nothing in evaluation either, so the logits are the same; in training tandem
    drops assignments past ``capacity_factor`` (a fine-tune of an imported Mixtral differs there, on purpose)."""
    architecture: str
    model_type: str
    qkv_bias: bool = False       # Qwen2: biases on q, k, v (never on o)
    qk_norm: bool = False        # Qwen3: RMSNorm on each head's queries and keys
    kind: str = "llama"
    moe: bool = False            # Mixtral: a mixture of experts in every block's MLP

    def fields(self, cfg: dict, folder: str = "", seq: int | None = None) -> dict:
        g = lambda k, d=None: _get(cfg, k, d, folder)  # noqa: E731
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise _bad("hidden_act", act, "tandem's Llama MLP is SwiGLU with silu", "use a silu model", folder)
        if cfg.get("mlp_bias"):
            raise _bad("mlp_bias", True, "tandem's Llama MLP has no biases", "use a model without mlp_bias", folder)
        if self.model_type in ("llama", "qwen3") and cfg.get("attention_bias"):
            raise _bad("attention_bias", True, "it puts a bias on o_proj too, which tandem's Llama does not have",
                       "use a model with attention_bias false", folder)
        drop = cfg.get("attention_dropout") or 0.0
        if drop:
            raise _bad("attention_dropout", drop, "tandem's models have no dropout (training would differ)",
                       "set attention_dropout to 0.0 in config.json", folder)
        for key in ("quantization_config", "partial_rotary_factor"):
            if cfg.get(key) not in (None, 1, 1.0):
                raise _bad(key, cfg[key], "not supported by tandem's Llama", f"use a model without {key}", folder)
        max_pos = int(g("max_position_embeddings", 2048))
        seq = seq or max_pos
        window = cfg.get("sliding_window")
        if self.model_type in ("mistral", "mixtral"):
            if window is not None and window < seq:
                raise _bad("sliding_window", window, f"attention windowed below model.seq {seq} (tandem's attention "
                           f"is full causal)", "set model.seq to at most the window, or sliding_window null", folder)
        elif cfg.get("use_sliding_window"):
            raise _bad("use_sliding_window", True, "tandem's attention is full causal, no window",
                       "use a model with use_sliding_window false", folder)
        types = cfg.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            other = next(t for t in types if t != "full_attention")
            raise _bad("layer_types", other, "tandem's attention is full causal in every layer",
                       "use a model whose layer_types are all full_attention", folder)
        heads = int(g("num_attention_heads"))
        hidden = int(g("hidden_size"))
        theta, scaling = _rope(cfg, folder)
        moe = {}
        if self.moe:
            jitter = cfg.get("router_jitter_noise") or 0.0
            if jitter:
                raise _bad("router_jitter_noise", jitter, "tandem's router adds no noise (training would differ)",
                           "set router_jitter_noise to 0.0 in config.json", folder)
            experts, top_k = int(g("num_local_experts")), int(g("num_experts_per_tok"))
            moe = {"experts": experts, "top_k": top_k, "shared_experts": 0, "expert_ffn": int(g("intermediate_size"))}
        return {**moe, "name": self.kind, "layers": int(g("num_hidden_layers")), "hidden": hidden, "heads": heads,
                "kv_heads": int(cfg.get("num_key_value_heads") or heads), "ffn": int(g("intermediate_size")),
                "head_dim": int(cfg.get("head_dim") or hidden // heads), "seq": seq, "vocab": int(g("vocab_size")),
                "tied": bool(cfg.get("tie_word_embeddings", False)), "rope_theta": theta, "rope_scaling": scaling,
                "norm_eps": float(g("rms_norm_eps", 1e-6)), "qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm}

    def config(self, m: dict) -> dict:
        hd = m.get("head_dim") or m["hidden"] // m["heads"]
        cfg = {"architectures": [self.architecture], "model_type": self.model_type, "vocab_size": m["vocab"],
               "hidden_size": m["hidden"], "intermediate_size": m["ffn"], "num_hidden_layers": m["layers"],
               "num_attention_heads": m["heads"], "num_key_value_heads": m.get("kv_heads") or m["heads"],
               "head_dim": hd, "max_position_embeddings": m["seq"], "rms_norm_eps": m["norm_eps"],
               "rope_theta": m["rope_theta"], "rope_scaling": dict(m["rope_scaling"]) or None,
               "tie_word_embeddings": m["tied"], "hidden_act": "silu", "attention_dropout": 0.0, "use_cache": True}
        if self.model_type in ("llama", "qwen3"):
            cfg["attention_bias"] = False
        if self.model_type == "llama":
            cfg["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3"):
            cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=m["layers"])
        if self.model_type in ("mistral", "mixtral"):
            cfg["sliding_window"] = None
        if self.moe:
            # router_aux_loss_coef: tandem's coefficient, though transformers' loss (one over all layers'
            # logits, only with output_router_logits) is not tandem's per-block sum; it is a training knob
            cfg.update(intermediate_size=m.get("expert_ffn") or m["ffn"], num_local_experts=m["experts"],
                       num_experts_per_tok=m["top_k"], router_jitter_noise=0.0, output_router_logits=False,
                       router_aux_loss_coef=m.get("router_aux_loss", 0.01))
        return cfg

    def rules(self, m: dict) -> list[Rule]:
        hd = m.get("head_dim") or m["hidden"] // m["heads"]
        h, q, kv, ffn = m["hidden"], m["heads"] * hd, (m.get("kv_heads") or m["heads"]) * hd, m["ffn"]
        out = [Rule("model.embed_tokens.weight", ("tok_emb.weight",), (m["vocab"], h))]
        for n in range(m["layers"]):
            p, t = f"model.layers.{n}.", f"layers.{n}."
            out += [Rule(p + "input_layernorm.weight", (t + "attn_norm.weight",), (h,)),
                    Rule(p + "self_attn.q_proj.weight", (t + "attn.wq.weight",), (q, h)),
                    Rule(p + "self_attn.k_proj.weight", (t + "attn.wk.weight",), (kv, h)),
                    Rule(p + "self_attn.v_proj.weight", (t + "attn.wv.weight",), (kv, h)),
                    Rule(p + "self_attn.o_proj.weight", (t + "attn.wo.weight",), (h, q))]
            if m["qkv_bias"]:
                out += [Rule(p + "self_attn.q_proj.bias", (t + "attn.wq.bias",), (q,)),
                        Rule(p + "self_attn.k_proj.bias", (t + "attn.wk.bias",), (kv,)),
                        Rule(p + "self_attn.v_proj.bias", (t + "attn.wv.bias",), (kv,))]
            if m["qk_norm"]:
                out += [Rule(p + "self_attn.q_norm.weight", (t + "attn.q_norm.weight",), (hd,)),
                        Rule(p + "self_attn.k_norm.weight", (t + "attn.k_norm.weight",), (hd,))]
            out.append(Rule(p + "post_attention_layernorm.weight", (t + "mlp_norm.weight",), (h,)))
            if self.moe:
                out += _mixtral_rules(m, p, t)
                continue
            out += [Rule(p + "mlp.gate_proj.weight", (t + "mlp.w1.weight",), (ffn, h)),
                    Rule(p + "mlp.up_proj.weight", (t + "mlp.w3.weight",), (ffn, h)),
                    Rule(p + "mlp.down_proj.weight", (t + "mlp.w2.weight",), (h, ffn))]
        out.append(Rule("model.norm.weight", ("norm.weight",), (h,)))
        if not m["tied"]:
            out.append(Rule("lm_head.weight", ("head.weight",), (m["vocab"], h)))
        return out


def _mixtral_rules(m: dict, p: str, t: str) -> list[Rule]:
    """One block's router and experts: Mixtral's checkpoint layout (``block_sparse_moe.experts.E.wN``: what
    transformers' save_pretrained writes, v4 and v5 alike, and what vLLM and SGLang read)."""
    h, e, ffn = m["hidden"], m["experts"], m.get("expert_ffn") or m["ffn"]
    out = [Rule(p + "block_sparse_moe.gate.weight", (t + "mlp.router.weight",), (e, h))]
    for j in range(e):
        q = f"{p}block_sparse_moe.experts.{j}."
        out += [Rule(q + "w1.weight", (t + "mlp.experts.w1",), (ffn, h), "expert", expert=j),
                Rule(q + "w2.weight", (t + "mlp.experts.w2",), (h, ffn), "expert", expert=j),
                Rule(q + "w3.weight", (t + "mlp.experts.w3",), (ffn, h), "expert", expert=j)]
    return out


# transformers' names -> tandem GPT's activation (gelu_new and gelu_pytorch_tanh: the same tanh formula)
GPT2_ACTIVATIONS = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class GPT2:
    """GPT2LMHeadModel onto tandem's GPT (learned positions, LayerNorm, exact-gelu MLP, biases)."""
    architecture: str = "GPT2LMHeadModel"
    model_type: str = "gpt2"
    kind: str = "gpt"

    def fields(self, cfg: dict, folder: str = "", seq: int | None = None) -> dict:
        g = lambda k, d=None: _get(cfg, k, d, folder)  # noqa: E731
        act = cfg.get("activation_function", "gelu_new")
        if act not in GPT2_ACTIVATIONS:
            raise _bad("activation_function", act, "tandem's GPT MLP computes gelu (exact) or gelu_new / "
                       "gelu_pytorch_tanh (the tanh approximation)", "use a model with one of those", folder)
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            v = cfg.get(key, 0.1)
            if v:
                raise _bad(key, v, "tandem's models have no dropout (training would differ)",
                           f"set {key} to 0.0 in config.json", folder)
        eps = cfg.get("layer_norm_epsilon", 1e-5)
        if eps != 1e-5:
            raise _bad("layer_norm_epsilon", eps, "tandem's GPT LayerNorm uses 1e-5", "use a model with 1e-5",
                       folder)
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
            if cfg.get(key, want) != want:
                raise _bad(key, cfg[key], "tandem's GPT attention does not do that", f"use {key} {want}", folder)
        hidden = int(g("n_embd"))
        n_pos = int(g("n_positions", 1024))
        if seq not in (None, n_pos):
            raise ConfigError(f"model.seq {seq} differs from n_positions {n_pos} of the GPT-2 checkpoint (its "
                              f"position table is a weight of that length)", field="model.seq", value=seq,
                              fix=f"leave model.seq out (it is {n_pos}), or give {n_pos}")
        return {"name": self.kind, "layers": int(g("n_layer")), "hidden": hidden, "heads": int(g("n_head")),
                "kv_heads": 0, "ffn": int(cfg.get("n_inner") or 4 * hidden), "seq": n_pos,
                "vocab": int(g("vocab_size")), "tied": bool(cfg.get("tie_word_embeddings", True)),
                "gelu": GPT2_ACTIVATIONS[act]}

    def config(self, m: dict) -> dict:
        return {"architectures": [self.architecture], "model_type": self.model_type, "vocab_size": m["vocab"],
                "n_embd": m["hidden"], "n_layer": m["layers"], "n_head": m["heads"], "n_positions": m["seq"],
                "n_inner": m["ffn"] or 4 * m["hidden"], "resid_pdrop": 0.0,
                "activation_function": "gelu_new" if m.get("gelu") == "tanh" else "gelu",
                "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
                "tie_word_embeddings": m["tied"], "use_cache": True}

    def rules(self, m: dict) -> list[Rule]:
        h, heads = m["hidden"], m["heads"]
        rep = heads // (m.get("kv_heads") or heads)
        ffn = m["ffn"] or 4 * h
        out = [Rule("transformer.wte.weight", ("tok_emb.weight",), (m["vocab"], h)),
               Rule("transformer.wpe.weight", ("pos_emb.weight",), (m["seq"], h))]
        for n in range(m["layers"]):
            p, t = f"transformer.h.{n}.", f"layers.{n}."
            out += [Rule(p + "ln_1.weight", (t + "ln1.weight",), (h,)), Rule(p + "ln_1.bias", (t + "ln1.bias",), (h,)),
                    Rule(p + "attn.c_attn.weight", tuple(t + f"attn.w{x}.weight" for x in "qkv"), (h, 3 * h), "qkv",
                         rep),
                    Rule(p + "attn.c_attn.bias", tuple(t + f"attn.w{x}.bias" for x in "qkv"), (3 * h,), "qkv_bias",
                         rep),
                    Rule(p + "attn.c_proj.weight", (t + "attn.wo.weight",), (h, h), "transpose"),
                    Rule(p + "attn.c_proj.bias", (t + "attn.wo.bias",), (h,)),
                    Rule(p + "ln_2.weight", (t + "ln2.weight",), (h,)), Rule(p + "ln_2.bias", (t + "ln2.bias",), (h,)),
                    Rule(p + "mlp.c_fc.weight", (t + "mlp.w1.weight",), (h, ffn), "transpose"),
                    Rule(p + "mlp.c_fc.bias", (t + "mlp.w1.bias",), (ffn,)),
                    Rule(p + "mlp.c_proj.weight", (t + "mlp.w2.weight",), (ffn, h), "transpose"),
                    Rule(p + "mlp.c_proj.bias", (t + "mlp.w2.bias",), (h,))]
        out += [Rule("transformer.ln_f.weight", ("norm.weight",), (h,)),
                Rule("transformer.ln_f.bias", ("norm.bias",), (h,))]
        if not m["tied"]:
            out.append(Rule("lm_head.weight", ("head.weight",), (m["vocab"], h)))
        return out


LLAMA = LlamaFamily("LlamaForCausalLM", "llama")
QWEN2 = LlamaFamily("Qwen2ForCausalLM", "qwen2", qkv_bias=True)
QWEN3 = LlamaFamily("Qwen3ForCausalLM", "qwen3", qk_norm=True)
MISTRAL = LlamaFamily("MistralForCausalLM", "mistral")
MIXTRAL = LlamaFamily("MixtralForCausalLM", "mixtral", moe=True)
GPT2_ = GPT2()
ARCHITECTURES = {a.architecture: a for a in (LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL, GPT2_)}
# why tandem's MoE Llama with shared experts has no Hugging Face class (checked against transformers 5.24)
SHARED_EXPERTS_WHY = ("Qwen2MoeForCausalLM scales its shared expert by a learned sigmoid gate "
                      "(shared_expert_gate) that tandem's ungated shared experts lack, so no mapping is exact, "
                      "and tandem maps no other shared-expert class (DeepSeek's has another attention, MLA)")


def _rope(cfg: dict, folder: str) -> tuple[float, dict]:
    """(rope_theta, tandem's rope_scaling) from either config.json style: transformers >= 5's
    ``rope_parameters`` (theta inside) or the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):   # one rotary per layer type (sliding + full)
        key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        raise _bad(key, cfg[key], "a rotary per layer type: tandem has one for every layer",
                   "use a model with one rope_parameters table", folder)
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if kind == "default":
        return theta, {}
    if kind not in ("linear", "llama3"):
        raise _bad("rope_scaling", kind, "tandem's rotary embeddings do default, linear and llama3 only",
                   "use a model with one of those rope types", folder)
    keys = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")
    return theta, {"rope_type": kind, **{k: params[k] for k in keys if k in params}}


def for_config(cfg: dict, folder: str = ""):
    """The adapter for a config.json's architecture; a ConfigError for one tandem does not map."""
    archs = cfg.get("architectures") or []
    if not archs:
        by_type = {a.model_type: a for a in ARCHITECTURES.values()}
        if cfg.get("model_type") in by_type:
            return by_type[cfg["model_type"]]
        raise ConfigError(f"{folder or '.'}/config.json names no architectures", field=FIELD,
                          value=f"{PREFIX}{folder}", fix=f"a causal LM saved by transformers: one of "
                                                          f"{', '.join(ARCHITECTURES)}")
    name = archs[0]
    if name not in ARCHITECTURES:
        raise ConfigError(f"architecture {name} is not supported", field=FIELD, value=name,
                          fix=f"import one of {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def for_model(m: dict):
    """The architecture an export writes for tandem's model ``m`` (a ModelSpec as a dict): the one it was
    imported from, else the one its options make (qk_norm: Qwen3, qkv_bias: Qwen2, else Llama; gpt: GPT-2)."""
    hf = m.get("hf") or {}
    if hf.get("architecture") in ARCHITECTURES:
        return ARCHITECTURES[hf["architecture"]]
    if m["name"] == "gpt":
        return GPT2_
    if m["name"] != "llama":
        raise ConfigError(f"model {m['name']!r} has no Hugging Face architecture", field="--format", value="hf",
                          fix="export --format hf a gpt or llama run (or one imported with model.name = 'hf:DIR'); "
                              "other models: the tandem format")
    if m.get("experts"):
        if m.get("shared_experts"):
            raise ConfigError(f"model.shared_experts {m['shared_experts']} has no Hugging Face class: "
                              f"{SHARED_EXPERTS_WHY}", field="--format", value="hf",
                              fix="export this run in tandem's format, or train with model.shared_experts = 0 "
                                  "(MixtralForCausalLM)")
        if m["qk_norm"] or m["qkv_bias"]:
            key = "qk_norm" if m["qk_norm"] else "qkv_bias"
            raise ConfigError(f"model.{key} with model.experts has no Hugging Face class tandem maps (Mixtral's "
                              f"attention has neither q/k norms nor q/k/v biases)", field="--format", value="hf",
                              fix="export this run in tandem's format")
        return MIXTRAL
    if m["qk_norm"] and m["qkv_bias"]:
        raise ConfigError("no Hugging Face architecture has both qk_norm and q/k/v biases alone (Qwen3's "
                          "attention_bias adds an o_proj bias)", field="--format", value="hf",
                          fix="export this run in tandem's format")
    return QWEN3 if m["qk_norm"] else QWEN2 if m["qkv_bias"] else LLAMA


# ---- the folder -----------------------------------------------------------------------------------------------


def read_config(folder: Path) -> dict:
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir() or not path.is_file():
        raise ConfigError(f"{folder} is not a Hugging Face model folder (no config.json)", field=FIELD,
                          value=f"{PREFIX}{folder}", fix="give a local folder written by transformers' "
                                                          "save_pretrained (config.json + *.safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not JSON ({e})", field=FIELD, value=f"{PREFIX}{folder}",
                          fix="give the folder transformers wrote") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} is not a JSON object", field=FIELD, value=f"{PREFIX}{folder}",
                          fix="give the folder transformers wrote")
    return cfg


def weight_map(folder: Path) -> dict[str, str]:
    """HF tensor name -> safetensors file (relative), from the index or the single model.safetensors."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is unreadable ({type(e).__name__})", field=FIELD, value=f"{PREFIX}{folder}",
                              fix="give the folder transformers wrote") from None
    single = folder / SINGLE
    if not single.is_file():
        bins = sorted(p.name for p in folder.glob("*.bin"))
        raise ConfigError(f"{folder} has no {SINGLE} nor {INDEX}" + (f" (only {bins[0]}: pickled weights)" if bins
                                                                      else ""), field=FIELD,
                          value=f"{PREFIX}{folder}", fix="save the model with save_pretrained(..., "
                                                          "safe_serialization=True) (safetensors)")
    return {name: SINGLE for name in header(single)}


def header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor table (name -> dtype, shape, offsets), read from its header only."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            table = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path.name} is not a readable safetensors file ({type(e).__name__})", field=FIELD,
                          value=f"{PREFIX}{path.parent}", fix="copy the file again from its source") from None
    table.pop("__metadata__", None)
    return table


# tensors some checkpoints store that hold nothing a model learns: old rotary tables and causal masks
IGNORED = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")


def check_folder(folder: Path, rules: list[Rule]) -> None:
    """Every tensor the model needs is in a file that exists, with the shape the config implies, and no
    tensor is left over (a weight tandem's module has no place for would be dropped without a word)."""
    folder = Path(folder)
    where = weight_map(folder)
    wanted = {r.hf for r in rules}
    tied = "lm_head.weight" not in wanted   # a tied head some writers store anyway: the embedding's copy
    extra = sorted(n for n in where if n not in wanted and not n.endswith(IGNORED)
                   and not (tied and n == "lm_head.weight"))
    if extra:
        raise ConfigError(f"{folder} holds tensor {extra[0]} ({where[extra[0]]}) that tandem's model of this "
                          f"config has no place for" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
                          field=FIELD, value=f"{PREFIX}{folder}",
                          fix="check config.json describes these weights (a bias or norm it does not declare)")
    headers: dict[str, dict] = {}
    for r in rules:
        if r.hf not in where:
            raise ConfigError(f"{folder} lacks tensor {r.hf} (config.json implies it)", field=FIELD,
                              value=f"{PREFIX}{folder}", fix="give the complete folder transformers wrote")
        f = where[r.hf]
        if f not in headers:
            if not (folder / f).is_file():
                raise ConfigError(f"shard {f} is missing (named by {INDEX})", field=FIELD, value=f"{PREFIX}{folder}",
                                  fix="copy every shard the index names into the folder")
            headers[f] = header(folder / f)
        got = headers[f].get(r.hf)
        if got is None:
            raise ConfigError(f"{f} does not hold {r.hf} (the index says it does)", field=FIELD,
                              value=f"{PREFIX}{folder}", fix="copy the shards again from their source")
        if tuple(got["shape"]) != r.shape:
            raise ConfigError(f"{r.hf} in {f} is {list(got['shape'])}, config.json implies {list(r.shape)}",
                              field=FIELD, value=f"{PREFIX}{folder}",
                              fix="give the config.json these weights were saved with")


def resolve(data: dict) -> dict:
    """A [model] table naming ``hf:DIR`` as tandem's own model: name, shape fields from config.json, and
    ``hf = {path, architecture, config}`` (config: the keys tandem does not model, carried to an export).
    A shape field the table also gives must agree; ``seq`` may be shorter (Llama family) than the
    checkpoint's max_position_embeddings (the rotary table is computed, not stored)."""
    folder = Path(str(data["name"])[len(PREFIX):]).expanduser()
    if not str(folder) or str(folder) == ".":
        raise ConfigError("hf: needs a folder", field=FIELD, value=data["name"], fix="write model.name = 'hf:DIR'")
    folder = folder.resolve()
    cfg = read_config(folder)
    arch = for_config(cfg, str(folder))
    seq = data.get("seq")
    fields = arch.fields(cfg, str(folder), int(seq) if seq is not None else None)
    if _norm(data.get("experts") or 0) and "experts" not in fields:
        raise ConfigError(f"model.experts = {data['experts']} but {folder} is a dense {arch.architecture}: its "
                          f"MLP weights would be dropped and the experts start from random", field="model.experts",
                          value=data["experts"], fix="leave model.experts out for a dense checkpoint")
    for k in SHAPE_FIELDS:
        if k in data and k in fields and _norm(data[k]) != _norm(fields[k]):
            raise ConfigError(f"model.{k} = {data[k]!r} but {folder}/config.json gives {fields[k]!r}",
                              field=f"model.{k}", value=data[k],
                              fix=f"leave model.{k} out: an hf: model takes its shape from config.json")
    if arch.kind == "llama" and seq is not None and int(seq) > int(cfg.get("max_position_embeddings") or seq):
        raise ConfigError(f"model.seq {seq} exceeds the checkpoint's max_position_embeddings "
                          f"{cfg['max_position_embeddings']}", field="model.seq", value=seq,
                          fix=f"give at most {cfg['max_position_embeddings']}")
    # the keys an export writes from tandem's own fields; the rest is carried. max_position_embeddings is kept
    # too: a Llama fine-tuned with a shorter model.seq is written back with the checkpoint's
    modelled = set(arch.config({"rope_scaling": {}, "rope_theta": 0.0, "norm_eps": 0.0, **fields}))
    modelled |= {"rope_parameters", "transformers_version", "torch_dtype", "dtype", "layer_types", "_name_or_path"}
    modelled.discard("max_position_embeddings")
    carried = {k: v for k, v in cfg.items() if k not in modelled}
    check_folder(folder, arch.rules({**fields, "kv_heads": fields.get("kv_heads") or fields["heads"]}))
    out = {k: v for k, v in data.items() if k != "name"}
    out.update(fields)
    out["hf"] = {"path": str(folder), "architecture": arch.architecture, "config": carried}
    return out


def _norm(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):   # a command-line override not yet typed (--model.experts 4)
        try:
            return float(v)
        except ValueError:
            return v
    return v
