"""prepare-text's token folder: manifest, sha256, a lossless round trip, the split; the windows of data.name=tokens."""

import hashlib
import json

import numpy as np
import pytest
import torch

from tandem.core.errors import ConfigError, DataError
from tandem.data.text import Codec, entropy_bits, prepare_text
from tandem.data.tokens import TokenWindows, check_folder, held_out_summary, load_tokens, spread


def _corpus(root, n=12):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "é", "λ", "\n", "def f(x):\n    return x\n"]
    for i in range(n):
        (root / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"d{i % 3}" / f"f{i}.txt").write_text(" ".join(rng.choice(words, 200)), encoding="utf-8")
    (root / "d0" / "blob.bin").write_bytes(bytes(range(256)))  # not UTF-8: skipped
    (root / "d0" / "skip.md").write_text("not matched")
    return root


def test_byte_folder_manifest_sha_and_round_trip(tmp_path):
    src = _corpus(tmp_path / "src")
    out = tmp_path / "tok"
    man = prepare_text([str(src)], out, globs=["*.txt", "*.bin"], held_out=0.25)
    assert sorted(p.name for p in out.iterdir()) == ["held_out.bin", "manifest.json", "train.bin"]
    assert json.loads((out / "manifest.json").read_text()) == man
    assert man["tokenizer"] == {"kind": "byte", "vocab": 256} and man["dtype"] == "uint8"
    assert man["skipped_not_utf8"] == 1
    texts = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*.txt")}
    for split in ("train", "held_out"):
        s = man["splits"][split]
        data = (out / s["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == s["sha256"]
        files = [f for f in man["files"] if f["split"] == split]
        # the token file is its files' bytes, in the manifest's order: nothing lost, nothing added
        assert data == b"".join(texts[f["file"]] for f in files)
        assert s["tokens"] == s["bytes"] == len(data) and s["files"] == len(files) >= 1
        counts = np.bincount(np.frombuffer(data, np.uint8), minlength=256)
        assert s["order0_bits_per_byte"] == pytest.approx(entropy_bits(counts))
    # whole files, about a quarter of the bytes held out, the same split on a second run
    ho = man["splits"]["held_out"]["bytes"] / sum(len(t) for t in texts.values())
    assert 0.2 <= ho < 0.45
    again = prepare_text([str(src)], tmp_path / "tok2", globs=["*.txt"], held_out=0.25)
    assert [f["split"] for f in again["files"]] == [f["split"] for f in man["files"]]
    with pytest.raises(ConfigError, match="--out: the output folder exists"):
        prepare_text([str(src)], out, globs=["*.txt"])
    assert not list(tmp_path.glob("*.tmp-*"))  # nothing half-written left


def test_entropy_of_known_histograms():
    assert entropy_bits(np.array([5, 5, 5, 5])) == pytest.approx(2.0)
    assert entropy_bits(np.array([7, 0, 0])) == 0.0


def test_one_file_is_cut_at_a_line_break(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("".join(f"line {i}\n" for i in range(1000)))
    man = prepare_text([str(f)], tmp_path / "tok", globs=["*"], held_out=0.1)
    train = (tmp_path / "tok" / "train.bin").read_bytes()
    held = (tmp_path / "tok" / "held_out.bin").read_bytes()
    assert train + held == f.read_bytes() and train.endswith(b"\n")
    assert man["splits"]["held_out"]["bytes"] == pytest.approx(0.1 * len(f.read_bytes()), rel=0.05)


def test_windows_are_fixed_offsets_shifted_by_one(tmp_path):
    tokens = np.arange(103, dtype=np.uint16)
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    ds = TokenWindows(path, "uint16", seq=10)
    assert len(ds) == 10  # (103 - 1) // 10 windows of 11 tokens, the last one ending at token 100
    for i in (0, 3, 9, -1):
        x, y = ds[i]
        start = (i % 10) * 10
        assert x.dtype == torch.int64 and x.tolist() == list(range(start, start + 10))
        assert y.tolist() == list(range(start + 1, start + 11))
    xb, yb = ds[[2, 5]]  # a batch, as evaluation reads it
    assert xb.shape == (2, 10) and torch.equal(xb[1], ds[5][0]) and torch.equal(yb[0], ds[2][1])
    with pytest.raises(IndexError):
        ds[10]
    assert spread(100, 4).tolist() == [0, 33, 66, 99] and spread(100, 0) is None and spread(5, 9) is None


def test_load_tokens_checks_the_folder(tmp_path):
    src = _corpus(tmp_path / "src")
    out = tmp_path / "tok"
    man = prepare_text([str(src)], out, globs=["*.txt"], held_out=0.25)
    train, held = load_tokens(str(out), seq=16, held_out=0.1, num_samples=5)
    assert len(train) == (man["splits"]["train"]["tokens"] - 1) // 16 and len(held) == 5
    assert held.order0 == man["splits"]["held_out"]["order0_bits_per_byte"]
    rec, text = held_out_summary(held, 1, 100, 100 * np.log(2) * 2.0)  # 2 bits per token, 1 token per byte
    assert rec["bits_per_byte"] == pytest.approx(2.0) and "2.000 bits per byte" in text
    assert load_tokens(str(out), 16, 0.0, 5)[1] is None
    with pytest.raises(DataError, match="model.seq"):
        check_folder(str(out), seq=10**7, need_held=False)
    raw = bytearray((out / "train.bin").read_bytes())
    raw[0] ^= 1
    (out / "train.bin").write_bytes(bytes(raw))
    check_folder(str(out), 16, True)  # sizes only (the workers)
    with pytest.raises(DataError, match="train.bin is altered"):
        check_folder(str(out), 16, True, verify=True)  # the parent also hashes
    (out / "held_out.bin").write_bytes(b"x")
    with pytest.raises(DataError, match="held_out.bin holds 1 bytes"):
        check_folder(str(out), 16, True)


def test_bpe_round_trip(tmp_path):
    pytest.importorskip("tokenizers")
    src = _corpus(tmp_path / "src")
    out = tmp_path / "bpe"
    man = prepare_text([str(src)], out, globs=["*.txt"], tokenizer="bpe", vocab=300, held_out=0.25)
    assert man["tokenizer"]["kind"] == "bpe" and 256 < man["vocab"] <= 300 and man["dtype"] == "uint16"
    s = man["splits"]["train"]
    assert s["tokens"] < s["bytes"]  # merges: fewer tokens than bytes
    codec = Codec(str(out))
    ids = np.fromfile(out / "train.bin", dtype="<u2").tolist()
    files = [f for f in man["files"] if f["split"] == "train"]
    text = b"".join((src / f["file"]).read_bytes() for f in files).decode()
    assert codec.decode(ids) == text and len(ids) == s["tokens"]
    with pytest.raises(ConfigError, match="--vocab"):
        prepare_text([str(src)], tmp_path / "x", globs=["*.txt"], tokenizer="bpe", vocab=100)
