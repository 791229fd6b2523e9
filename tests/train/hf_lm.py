"""Hugging Face causal LMs as a user's own factories (``model.name = "train.hf_lm:tiny_llama"``), made with
``from_config`` (no download): the ``transformers`` side of the loss = "model" and export tests."""

from __future__ import annotations


def config(vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, seq: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                       max_position_embeddings=seq, tie_word_embeddings=False)


def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, seq: int = 32):
    """A freshly initialised LlamaForCausalLM; its forward names input_ids= and labels=."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config(vocab, hidden, layers, heads, seq))


def from_folder(path: str):
    """A saved checkpoint, loaded with from_pretrained (refused under a meta-device context)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)
