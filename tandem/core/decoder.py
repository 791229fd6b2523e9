"""The built-in decoders' shape rules, checked before any process starts (no torch here).

    DECODERS                      # model names that read token sequences and split by tp / pp
    ffn_size(m), head_dim(m)      # the sizes a 0 in the spec stands for
    check_llama(m)                # one-line ConfigErrors: field, value, fix

``m`` is a ``ModelSpec`` or anything with its field names (``tandem/models/llama.py``'s
config checks itself with the same function, so a model built in Python gets the same
errors as a spec).
"""

from __future__ import annotations

import math

from tandem.core.errors import ConfigError

DECODERS = ("gpt", "llama")

# rope_scaling: Hugging Face's keys (config.json's "rope_scaling"), and Llama 3.1's values where one is left out
ROPE_SCALING = {
    "linear": {"factor": None},
    "llama3": {"factor": None, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
}


def ffn_size(m) -> int:
    """The MLP's inner size: the spec's, else 4 x hidden (GPT) or Llama's SwiGLU rule, 2/3 of
    4 x hidden rounded up to a multiple of 256 (the same parameter count as a 4 x hidden GELU MLP)."""
    if m.ffn:
        return m.ffn
    if m.name == "llama":
        return 256 * math.ceil(int(8 * m.hidden / 3) / 256)
    return 4 * m.hidden


def head_dim(m) -> int:
    return getattr(m, "head_dim", 0) or m.hidden // m.heads


def rope_scaling(m) -> dict:
    """The spec's rope_scaling with its defaults filled in; {} for none."""
    raw = dict(m.rope_scaling or {})
    if not raw:
        return {}
    kind = raw.pop("rope_type", None) or raw.pop("type", None)
    fix = "give rope_scaling = {rope_type = \"llama3\", factor = 8.0} (or \"linear\"), or {} for none"
    if kind not in ROPE_SCALING:
        raise ConfigError(f"rope_type {kind!r} is not one of {', '.join(ROPE_SCALING)}",
                          field="model.rope_scaling", value=kind, fix=fix)
    keys = ROPE_SCALING[kind]
    for k in raw:
        if k not in keys:
            raise ConfigError(f"{k!r} is not a {kind} rope_scaling key ({', '.join(keys)})",
                              field="model.rope_scaling", value=k, fix=f"drop {k!r}, or use one of: {', '.join(keys)}")
    out = {"rope_type": kind}
    for k, default in keys.items():
        v = raw.get(k, default)
        if v is None:
            raise ConfigError(f"{kind} rope_scaling needs {k!r}", field="model.rope_scaling", value=kind, fix=fix)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"rope_scaling {k} must be a positive number, got {v!r}", field="model.rope_scaling",
                              value=v, fix=f"give {k} > 0")
        out[k] = float(v) if k != "original_max_position_embeddings" else int(v)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ConfigError(f"high_freq_factor {out['high_freq_factor']} must exceed low_freq_factor "
                          f"{out['low_freq_factor']}", field="model.rope_scaling", value=out["high_freq_factor"],
                          fix="use Llama 3.1's low_freq_factor 1.0 and high_freq_factor 4.0")
    return out


def _need(cond: bool, message: str, field: str, value, fix: str) -> None:
    if not cond:
        raise ConfigError(message, field=field, value=value, fix=fix)


def check_llama(m) -> None:
    """Raise a ConfigError for a Llama shape that cannot be built."""
    for k in ("layers", "hidden", "heads", "seq", "vocab"):
        _need(getattr(m, k) >= 1, f"must be at least 1, got {getattr(m, k)}", f"model.{k}", getattr(m, k),
              "give a positive size")
    for k in ("kv_heads", "ffn", "head_dim"):
        _need(getattr(m, k) >= 0, f"must be 0 (the default) or more, got {getattr(m, k)}", f"model.{k}",
              getattr(m, k), "give 0 or a positive size")
    kv = m.kv_heads or m.heads
    if not m.head_dim:
        _need(m.hidden % m.heads == 0, f"hidden {m.hidden} is not divisible by heads {m.heads} ({m.hidden} % "
              f"{m.heads} = {m.hidden % m.heads})", "model.heads", m.heads,
              "choose heads that divide hidden, or give model.head_dim")
    _need(m.heads % kv == 0, f"heads {m.heads} is not divisible by kv_heads {kv} ({m.heads} % {kv} = "
          f"{m.heads % kv}): each key/value head serves heads / kv_heads query heads", "model.kv_heads", kv,
          "choose kv_heads that divide heads")
    hd = head_dim(m)
    _need(hd % 2 == 0, f"head_dim {hd} is odd: rotary embeddings turn its features in pairs", "model.head_dim"
          if m.head_dim else "model.heads", hd, "use an even head_dim (hidden / heads)")
    _need(m.rope_theta > 0, f"rope_theta must be positive, got {m.rope_theta}", "model.rope_theta", m.rope_theta,
          "use 10000 (Llama 2), 500000 (Llama 3) or 1000000 (Qwen)")
    _need(m.norm_eps > 0, f"norm_eps must be positive, got {m.norm_eps}", "model.norm_eps", m.norm_eps,
          "use 1e-5 (Llama) or 1e-6 (Qwen)")
    rope_scaling(m)
