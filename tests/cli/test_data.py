"""`tandem data prepare-text` and `tandem generate` as a user types them: usage errors and bad input are one
line and exit 2; prepare-text prints its splits."""

import json

import pytest

from tandem_testing import tandem_in_process as run


@pytest.mark.parametrize("args,line", [
    (["data"], "Usage: tandem data"),
    (["data", "prepare-text", "x"], "error: --out: missing option. Fix: tandem data prepare-text [OPTIONS] SRC...;"),
    (["data", "prepare-text", "no/such/folder", "--out", "o"], "error: SRC: no such file or folder"),
    (["data", "prepare-text", "examples", "--out", "o", "--tokenizer", "zip"], "error: --tokenizer: unknown"),
    (["data", "prepare-text", "examples", "--out", "o", "--glob", "*.none"], "error: SRC: no file matches *.none"),
    (["generate", "runs/nowhere", "--prompt", "x"], "error: RUN_DIR: no such run dir, checkpoint or export folder"),
    (["generate", "examples", "--prompt", "x", "--tokens", "0"], "error: --tokens: must be at least 1"),
    (["spec", "examples/gpt_reverse.toml", "--data.name", "tokens"], "error: data.path: data.name = tokens needs"),
    (["spec", "examples/gpt_reverse.toml", "--data.name", "tokens", "--data.path", "examples"],
     "error: data.path: not a token folder (no manifest.json) (got 'examples')"),
])
def test_bad_input_is_one_line(args, line, capsys, monkeypatch):
    code, out, err = run(args, capsys, monkeypatch)
    assert code == 2, (out, err)
    assert "Traceback" not in err and line in out + err, (out, err)


def test_prepare_text_prints_its_splits(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text("hello world\n" * (10 + i))
    code, out, err = run(["data", "prepare-text", str(src), "--out", str(tmp_path / "tok"), "--held-out", "0.2"],
                         capsys, monkeypatch)
    assert code == 0, err
    man = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    h = man["splits"]["held_out"]
    assert out.splitlines()[0] == f"wrote {tmp_path / 'tok'}: byte tokenizer, vocabulary 256, uint8 tokens"
    assert f"  held-out: 1 files, {h['bytes']} bytes, {h['tokens']} tokens (1.000 per byte), order-0 entropy " \
           f"{h['order0_bits_per_byte']:.3f} bits per byte" in out
    assert "tokenize" in err  # the progress bar, on stderr
    code, _, err = run(["data", "prepare-text", str(src), "--out", str(tmp_path / "tok")], capsys, monkeypatch)
    assert code == 2 and "error: --out: the output folder exists" in err
