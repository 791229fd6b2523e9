"""Tiny Hugging Face checkpoints made in the test (``from_config`` + ``save_pretrained``, never downloaded), one
per architecture tandem imports, with every norm and bias moved off its initial 1 or 0 so a wrong mapping shows."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

VOCAB, SEQ = 40, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, tie_word_embeddings=False)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama-tied-llama3": ("LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=True, rope_theta=500000.0,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 4})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, rms_norm_eps=1e-6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=12, rope_theta=1e6, rms_norm_eps=1e-6)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, rope_theta=10000.0)),
    # 4 experts of 48 units, top 2 (transformers' save_pretrained writes block_sparse_moe.experts.E.w1/w2/w3)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                             sliding_window=None, rope_theta=1e6)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", None),
    "gpt2-gelu-new": ("GPT2Config", "GPT2LMHeadModel", None),   # GPT-2's own activation (the tanh gelu)
}


def transformers_or_skip():
    from tandem_testing import skip_here_fail_in_ci

    try:
        import transformers
    except ImportError:
        skip_here_fail_in_ci("transformers is not installed (pip install 'tandem[test]')", "the Hugging Face tests")
    return transformers


def hf_config(arch: str, **over):
    transformers = transformers_or_skip()
    cfg_cls, _, extra = ARCHS[arch]
    cls = getattr(transformers, cfg_cls)
    if extra is None:  # GPT-2: the exact gelu and no dropout, as tandem's GPT
        kw = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                  activation_function="gelu_new" if arch == "gpt2-gelu-new" else "gelu",
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        kw = {**COMMON, **extra}
        theta, scaling = kw.pop("rope_theta"), kw.pop("rope_scaling", None)
        if "rope_parameters" in inspect.signature(cls.__init__).parameters or hasattr(cls, "__dataclass_fields__") \
                and "rope_parameters" in cls.__dataclass_fields__:   # transformers >= 5
            kw["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
        else:
            kw.update(rope_theta=theta, rope_scaling=scaling)
    kw.update(over)
    return cls(**kw)


def make(folder: Path, arch: str, seed: int = 0, **over):
    """Save a random ``arch`` checkpoint to ``folder``; returns the transformers model (eval, fp32)."""
    transformers = transformers_or_skip()
    cfg = hf_config(arch, **over)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch][1])(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape))
    model.save_pretrained(str(folder))
    return model


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
