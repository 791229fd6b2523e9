"""prepare-text --tokenizer DIR: a Hugging Face tokenizer.json (made here with the tokenizers library, never
downloaded) encodes the token folder, travels with it, and reads back as the same ids."""

import hashlib

import numpy as np
import pytest

from tandem.data.text import Codec, prepare_text
from tandem.data.tokens import load_tokens
from tandem_testing import tandem_in_process as run
from train.hf_lm import TEXT, make_tokenizer

tokenizers = pytest.importorskip("tokenizers")

def corpus(root, n=8):
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"f{i}.txt").write_text("".join(TEXT[(i + j) % len(TEXT)] for j in range(30)), encoding="utf-8")
    return root


def test_folder_encoded_with_the_given_tokenizer_and_read_back(tmp_path):
    tok = make_tokenizer(tmp_path / "base")
    src = corpus(tmp_path / "src")
    out = tmp_path / "tok"
    man = prepare_text([str(src)], out, globs=["*.txt"], tokenizer=str(tmp_path / "base"), held_out=0.25)
    rec = man["tokenizer"]
    assert rec["kind"] == "hf" and man["vocab"] == rec["vocab"] == tok.get_vocab_size() and man["dtype"] == "uint16"
    assert rec["sha256"] == hashlib.sha256((tmp_path / "base" / "tokenizer.json").read_bytes()).hexdigest()
    assert rec["special_tokens"] == {"bos": {"token": "<s>", "id": 0}, "eos": {"token": "</s>", "id": 1},
                                     "pad": {"token": "<pad>", "id": 2}}
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the files travel with the tokens, byte for byte
        assert (out / f).read_bytes() == (tmp_path / "base" / f).read_bytes()
    # train.bin: each train file as tokenizers encodes it, its own tokens only (no <s> per file)
    files = [f for f in man["files"] if f["split"] == "train"]
    want = [i for f in files for i in tok.encode((src / f["file"]).read_text(), add_special_tokens=False).ids]
    assert np.fromfile(out / "train.bin", dtype="<u2").tolist() == want
    assert 0 not in want and man["splits"]["train"]["tokens"] == len(want) < man["splits"]["train"]["bytes"]
    codec = Codec(str(out))
    text = "the lazy fox returns a + b, λ é\n"
    assert codec.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert codec.decode(codec.encode(text)) == text and codec.special["eos"]["id"] == 1
    train, held = load_tokens(str(out), 8, 0.25, 0)  # the windows know the range of their ids (export's input)
    assert train.vocab == held.vocab == tok.get_vocab_size()


def test_the_file_itself_and_no_config(tmp_path):
    tok = make_tokenizer(tmp_path / "base", config=False)
    man = prepare_text([str(corpus(tmp_path / "src"))], tmp_path / "tok", globs=["*.txt"],
                       tokenizer=str(tmp_path / "base" / "tokenizer.json"), held_out=0.25)
    assert man["tokenizer"]["special_tokens"] == {} and "config_file" not in man["tokenizer"]
    assert man["vocab"] == tok.get_vocab_size() and not (tmp_path / "tok" / "tokenizer_config.json").exists()


def test_bad_tokenizers_are_one_line(tmp_path, capsys, monkeypatch):
    src = corpus(tmp_path / "src")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    make_tokenizer(tmp_path / "base")
    prepare = ["data", "prepare-text", str(src), "--glob", "*.txt", "--held-out", "0.25"]
    for tokenizer, line in [
            (tmp_path / "empty", "error: --tokenizer: no tokenizer.json in the folder"),
            (tmp_path / "junk", "error: --tokenizer: tokenizer.json is not a Hugging Face tokenizer"),
            (tmp_path / "nowhere", "error: --tokenizer: unknown tokenizer")]:
        code, out, err = run([*prepare, "--out", str(tmp_path / "o"), "--tokenizer", str(tokenizer)],
                             capsys, monkeypatch)
        assert code == 2 and "Traceback" not in err and line in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "o").exists()
    code, out, err = run([*prepare, "--out", str(tmp_path / "tok"), "--tokenizer", str(tmp_path / "base")],
                         capsys, monkeypatch)
    assert code == 0, err
    assert out.splitlines()[0] == f"wrote {tmp_path / 'tok'}: hf tokenizer, vocabulary 320, uint16 tokens"
    # a model whose vocabulary is smaller than the tokenizer's is refused before any worker starts
    code, out, err = run(["spec", "examples/gpt_reverse.toml", "--data.name", "tokens", "--data.path",
                          str(tmp_path / "tok")], capsys, monkeypatch)
    assert code == 2 and "error: model.vocab: the token folder's vocabulary is 320 (hf), the model's 16" in err, err
    pytest.importorskip("transformers")  # and a factory's transformers model, by its input embedding
    code, out, err = run(["spec", "examples/gpt_reverse.toml", "--model.name", "train.hf_lm:tiny_llama",
                          "--data.name", "tokens", "--data.path", str(tmp_path / "tok")], capsys, monkeypatch)
    assert code == 2 and "error: model.name: the token folder's vocabulary is 320 (hf), the model's input " \
                         "embedding has 16 rows" in err, err
