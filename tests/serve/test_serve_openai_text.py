"""The OpenAI routes' text, without a server: the export's tokenizer (or byte-level, or none), the chat
template, and a choice's incremental text (stop strings across tokens, UTF-8 held back, stop ids)."""

from __future__ import annotations

import json

import pytest

from tandem.serve.llm_metrics import LLMMetrics
from tandem.serve.openai_api import Choice
from tandem.serve.tokenizer import DEFAULT_CHAT_TEMPLATE, NoTokenizer, TextCodec


def _choice(codec, stops=(), stop_ids=(), stream=True):
    from prometheus_client import CollectorRegistry

    return Choice(0, [1], {}, codec, list(stops), set(stop_ids), LLMMetrics(CollectorRegistry()), 0.0, stream,
                  lambda c: None)


def test_byte_level_and_no_tokenizer(tmp_path):
    byte = TextCodec(tmp_path, 256)
    assert byte.kind == "byte" and byte.encode("hé") == [104, 195, 169] and byte.decode([104, 195, 169]) == "hé"
    none = TextCodec(tmp_path, 300)   # no tokenizer.json and not 256 tokens: token ids only
    assert not none.text
    with pytest.raises(NoTokenizer, match="tokenizer.json"):
        none.encode("hi")
    assert byte.chat_template == DEFAULT_CHAT_TEMPLATE
    assert byte.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def test_tokenizer_json_and_config(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world"] * 20, trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",   # transformers saves either form
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    c = TextCodec(tmp_path, tok.get_vocab_size())
    assert c.kind == "hf" and c.eos_id == tok.token_to_id("</s>") and c.bos_token == "<s>"
    assert c.encode("hello world") == tok.encode("hello world").ids
    assert c.render_chat([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"
    assert c.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<s>[user]hi"


def test_stop_string_across_tokens_is_cut_and_never_streamed(tmp_path):
    c = _choice(TextCodec(tmp_path, 256), stops=["END"])
    out = []
    for piece in ("abc E", "N", "D tail"):   # "END" arrives over three frames
        c.on_tokens(list(piece.encode()), len(c.toks))
        out.append(c.advance())
    assert "".join(out) == "abc " and c.finish == "stop" and c.text == "abc "
    assert out == ["abc", " ", ""]   # the last len("END") - 1 characters wait: they might begin END
    assert c.completion_tokens == len("abc END")   # up to the token that completed the stop


def test_utf8_is_held_back_until_complete_and_length_flushes(tmp_path):
    c = _choice(TextCodec(tmp_path, 256))
    e = "é".encode()
    c.on_tokens([ord("a"), e[0]], 0)
    assert c.advance() == "a"           # half of é: not sent as U+FFFD
    c.on_tokens([e[1]], 2)
    assert c.advance() == "é"
    c.engine_done = True
    assert c.advance() == "" and c.finish == "length"


def test_stop_token_id_ends_without_being_returned(tmp_path):
    c = _choice(TextCodec(tmp_path, 256), stop_ids=[ord("!")])
    c.on_tokens(list(b"hi!more"), 0)
    assert c.advance() == "hi" and c.finish == "stop" and c.kept == list(b"hi") and c.completion_tokens == 3


def test_a_lost_replica_fails_a_stream_only_after_it_sent_text(tmp_path):
    c = _choice(TextCodec(tmp_path, 256))
    c.on_tokens(list(b"x"), 0)
    assert not c.on_lost() and c.toks == []   # nothing sent yet: retried from the start
    c.on_tokens(list(b"xy"), 0)
    c.advance()
    assert c.on_lost()                        # text went out: a retry would send it twice
    quiet = _choice(TextCodec(tmp_path, 256), stream=False)
    quiet.on_tokens(list(b"xy"), 0)
    quiet.advance()
    assert not quiet.on_lost()                # not streamed: the answer is still whole
