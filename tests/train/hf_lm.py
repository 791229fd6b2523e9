"""Hugging Face pieces made locally (never downloaded): causal LMs as a user's own factories
(``model.name = "train.hf_lm:tiny_llama"``, built from a config) and a tokenizer.json trained here, for the
loss = "model", prepare-text --tokenizer and export tests."""

from __future__ import annotations

import json

TEXT = ["the quick brown fox jumps over the lazy dog\n", "def add(a, b):\n    return a + b\n",
        "λ calculus and é accents\n", "numbers 12345 67890\n"]


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


def make_tokenizer(folder, config=True):
    """A byte-level BPE with <s> and </s>, a post-processor that prepends <s> (as Llama's does), saved as
    a model's folder would hold it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False, "normalized": False},
            "pad_token": "<pad>", "model_max_length": 128}))
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def corpus_files(root, n=8):
    """n text files of the TEXT lines, a few kilobytes in all."""
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"f{i}.txt").write_text("".join(TEXT[(i + j) % len(TEXT)] for j in range(30)), encoding="utf-8")
    return root
