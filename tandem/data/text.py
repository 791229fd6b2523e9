"""``tandem data prepare-text``: text files -> a token file per split + manifest.json.

Layout of ``--out DIR`` (the contract ``data.name = "tokens"`` reads, tandem/data/tokens.py):

    train.bin, held_out.bin   raw little-endian tokens (uint8 for vocab <= 256, else uint16/uint32),
                              read back with np.memmap(path, dtype, mode="r")
    tokenizer.json            the BPE (``--tokenizer bpe``) or the given one (``--tokenizer DIR``), Hugging
                              Face tokenizers' format
    tokenizer_config.json     ``--tokenizer DIR`` only, where DIR has one (its special tokens)
    manifest.json             format, tokenizer, dtype, per split: files, bytes, tokens, sha256 of the
                              token file, order-0 byte entropy (bits per byte) of its text; every source file

The held-out split is made of whole files, picked in the order of the sha256 of their path relative to
their SRC (stable, spread over the folder tree) until it holds ``--held-out`` of the bytes; a single
file is cut at a line break instead. Files that are not UTF-8 (binaries, .pyc) are skipped and counted.
The folder is written as DIR.tmp-PID and renamed when complete: an interrupted run leaves no DIR.
``Codec`` reads a folder's tokenizer back (text <-> token ids, for tandem generate).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandem.core.errors import ConfigError, DataError

FORMAT, VERSION = "tandem-tokens", 1
MANIFEST = "manifest.json"
SPLITS = {"train": "train.bin", "held_out": "held_out.bin"}
TOKENIZERS = ("byte", "bpe")
TOKENIZER_VALID = "byte | bpe | a folder holding a Hugging Face tokenizer.json (or the file itself)"
HF_FILE, HF_CONFIG = "tokenizer.json", "tokenizer_config.json"
SPECIAL = ("bos", "eos", "pad", "unk")


@dataclass
class Piece:
    """A source file, or a byte range of one (the cut of a single-file corpus)."""
    path: Path
    rel: str
    size: int
    start: int = 0
    end: int | None = None

    def read(self) -> bytes:
        data = self.path.read_bytes()
        return data[self.start:self.end]


@dataclass
class SplitStats:
    files: int = 0
    bytes: int = 0
    tokens: int = 0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(256, dtype=np.int64))
    sha: object = field(default_factory=hashlib.sha256)

    def record(self) -> dict:
        return {"file": "", "files": self.files, "bytes": self.bytes, "tokens": self.tokens,
                "tokens_per_byte": self.tokens / self.bytes if self.bytes else 0.0,
                "order0_bits_per_byte": entropy_bits(self.counts), "sha256": self.sha.hexdigest()}


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol of a histogram: what a model that knows only the symbol
    frequencies (no context) pays per byte."""
    n = counts.sum()
    if n == 0:
        return 0.0
    p = counts[counts > 0] / n
    return float(-(p * np.log2(p)).sum())


def token_dtype(vocab: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab <= 256 else np.uint16 if vocab <= 65536 else np.uint32)


def find_files(srcs: list[str], globs: list[str], excludes: list[str]) -> list[tuple[Path, str]]:
    """(path, name relative to its SRC) of every file under SRC... matching a glob, sorted, excluded
    ones (a pattern matching the relative path or any of its folder names) left out."""
    found: dict[Path, str] = {}
    for src in srcs:
        root = Path(src)
        if root.is_file():
            found.setdefault(root.resolve(), root.name)
            continue
        if not root.is_dir():
            raise DataError("no such file or folder", field="SRC", value=src,
                            fix="give text files or folders that hold them")
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if not p.is_file() or not any(fnmatch.fnmatch(p.name, g) for g in globs):
                continue
            if any(fnmatch.fnmatch(rel, x) or any(fnmatch.fnmatch(part, x) for part in rel.split("/")[:-1])
                   for x in excludes):
                continue
            found.setdefault(p.resolve(), rel)
    if not found:
        raise DataError(f"no file matches {' '.join(globs)}", field="SRC", value=" ".join(srcs),
                        fix="check the folders and --glob / --exclude")
    return sorted(((p, r) for p, r in found.items()), key=lambda t: t[1])


def split_pieces(files: list[tuple[Path, str]], held_out: float) -> dict[str, list[Piece]]:
    pieces = [Piece(p, r, p.stat().st_size) for p, r in files]
    if held_out <= 0:
        return {"train": pieces, "held_out": []}
    if len(pieces) == 1:  # one file (a book, a dump): cut it at a line break near the end
        p = pieces[0]
        data = p.path.read_bytes()
        cut = data.rfind(b"\n", 0, int(len(data) * (1 - held_out))) + 1 or int(len(data) * (1 - held_out))
        return {"train": [Piece(p.path, p.rel, cut, 0, cut)],
                "held_out": [Piece(p.path, p.rel + f"[{cut}:]", len(data) - cut, cut, None)]}
    total, held, chosen = sum(p.size for p in pieces), 0, set()
    for p in sorted(pieces, key=lambda p: hashlib.sha256(p.rel.encode()).hexdigest()):
        if held >= held_out * total or len(chosen) == len(pieces) - 1:
            break
        chosen.add(p.rel)
        held += p.size
    return {"train": [p for p in pieces if p.rel not in chosen], "held_out": [p for p in pieces if p.rel in chosen]}


class ByteTokenizer:
    kind, vocab = "byte", 256

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    def record(self) -> dict:
        return {"kind": "byte", "vocab": 256}


class BPETokenizer:
    """A byte-level BPE trained on the train split (Hugging Face tokenizers): lossless on any UTF-8."""

    kind = "bpe"

    def __init__(self, vocab: int, texts, out: Path) -> None:
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        except ImportError:
            raise ConfigError("the BPE tokenizer needs the tokenizers library", field="--tokenizer", value="bpe",
                              fix="pip install 'tandem[text]' (or pip install tokenizers), or use --tokenizer "
                                  "byte") from None
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False, special_tokens=[],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        self.tok, self.vocab, self.file = tok, tok.get_vocab_size(), out / "tokenizer.json"
        tok.save(str(self.file))

    def encode(self, text: bytes) -> np.ndarray:
        return np.asarray(self.tok.encode(text.decode("utf-8")).ids, dtype=np.int64)

    def record(self) -> dict:
        return {"kind": "bpe", "vocab": self.vocab, "file": self.file.name,
                "sha256": hashlib.sha256(self.file.read_bytes()).hexdigest()}


class HFTokenizer:
    """A Hugging Face tokenizer given as a folder holding ``tokenizer.json`` (``tokenizer_config.json``
    optional: its bos/eos/pad/unk tokens are recorded), or that file itself: the base model's tokens,
    for a fine-tune. The text is encoded as ``tokenizers`` encodes it with ``add_special_tokens=False``:
    the text's own tokens, no bos/eos inserted. Both files are copied into the token folder."""

    kind = "hf"

    def __init__(self, src: str) -> None:
        path = Path(src)
        file = path / HF_FILE if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"no {HF_FILE} in the folder" if path.is_dir() else
                              f"unknown tokenizer {src!r}: neither byte nor bpe, nor a file or folder",
                              field="--tokenizer", value=src,
                              fix=f"use {TOKENIZER_VALID}" if not path.is_dir() else
                                  "give the folder a Hugging Face model's tokenizer.json is in (save_pretrained "
                                  "writes it), or the file")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("a Hugging Face tokenizer needs the tokenizers library", field="--tokenizer",
                              value=src, fix="pip install 'tandem[text]' (or pip install tokenizers)") from None
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own Exception subclass for a malformed file
            why = " ".join(str(e).split())[:160]
            raise ConfigError(f"{file.name} is not a Hugging Face tokenizer ({type(e).__name__}: {why})",
                              field="--tokenizer", value=src,
                              fix="give a tokenizer.json written by the tokenizers library or save_pretrained") \
                from None
        self.file, self.vocab = file, self.tok.get_vocab_size(with_added_tokens=True)
        self.config = file.with_name(HF_CONFIG) if file.with_name(HF_CONFIG).is_file() else None
        self.special = self._special_tokens(src)

    def _special_tokens(self, src: str) -> dict:
        """{"bos": {"token": "<s>", "id": 1}, ...} from tokenizer_config.json, the ones it names."""
        if self.config is None:
            return {}
        try:
            cfg = json.loads(self.config.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"unreadable {HF_CONFIG} ({type(e).__name__}: {e})", field="--tokenizer", value=src,
                              fix=f"fix or remove {self.config}") from None
        out = {}
        for name in SPECIAL:
            tok = cfg.get(f"{name}_token")
            tok = tok.get("content") if isinstance(tok, dict) else tok  # an AddedToken, serialised
            if isinstance(tok, str):
                out[name] = {"token": tok, "id": self.tok.token_to_id(tok)}
        return out

    def copy_to(self, out: Path) -> None:
        shutil.copyfile(self.file, out / HF_FILE)
        if self.config is not None:
            shutil.copyfile(self.config, out / HF_CONFIG)

    def encode(self, text: bytes) -> np.ndarray:
        return np.asarray(self.tok.encode(text.decode("utf-8"), add_special_tokens=False).ids, dtype=np.int64)

    def record(self) -> dict:
        rec = {"kind": "hf", "vocab": self.vocab, "file": HF_FILE,
               "sha256": hashlib.sha256(self.file.read_bytes()).hexdigest(), "source": str(self.file.resolve()),
               "special_tokens": self.special}
        if self.config is not None:
            rec["config_file"] = HF_CONFIG
        return rec


def _text(piece: Piece) -> bytes | None:
    data = piece.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def prepare_text(srcs: list[str], out: Path, *, globs: list[str], excludes: list[str] = (),
                 tokenizer: str = "byte", vocab: int = 0, held_out: float = 0.05, force: bool = False,
                 progress=None) -> dict:
    """Write the token folder; returns its manifest. ``progress(description, total_bytes)`` returns a
    callable advanced by each file's bytes (the CLI's rich bar), or None for none."""
    hf = None if tokenizer in TOKENIZERS else HFTokenizer(tokenizer)  # checked before any file is read
    if tokenizer == "bpe" and vocab < 257:
        raise ConfigError(f"a BPE vocabulary of {vocab} adds no merge to the 256 bytes", field="--vocab",
                          value=vocab, fix="give --vocab 512 or more (e.g. 4096)")
    if not 0 <= held_out < 1:
        raise ConfigError(f"{held_out} is not a fraction in [0, 1)", field="--held-out", value=held_out,
                          fix="use e.g. 0.05")
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError("the output folder exists", field="--out", value=str(out),
                          fix="give a new --out, or --force to replace it")
    pieces = split_pieces(find_files(srcs, globs, list(excludes)), held_out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        manifest = _write(pieces, tmp, hf or tokenizer, vocab, progress)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write(pieces: dict[str, list[Piece]], tmp: Path, tokenizer, vocab: int, progress) -> dict:
    total = sum(p.size for ps in pieces.values() for p in ps)
    if isinstance(tokenizer, HFTokenizer):
        tok = tokenizer
        tok.copy_to(tmp)
    elif tokenizer == "bpe":
        advance = progress("train bpe", sum(p.size for p in pieces["train"])) if progress else None

        def texts():
            for p in pieces["train"]:
                data = _text(p)
                if advance:
                    advance(p.size)
                if data is not None:
                    yield data.decode("utf-8")

        tok = BPETokenizer(vocab, texts(), tmp)
    else:
        tok = ByteTokenizer()
    dtype = token_dtype(tok.vocab)
    advance = progress("tokenize", total) if progress else None
    stats, files, skipped = {s: SplitStats() for s in SPLITS}, [], 0
    for split, name in SPLITS.items():
        st = stats[split]
        with open(tmp / name, "wb") as fh:
            for p in pieces[split]:
                data = _text(p)
                if advance:
                    advance(p.size)
                if data is None:
                    skipped += 1
                    continue
                ids = tok.encode(data).astype(dtype)
                raw = ids.astype(dtype.newbyteorder("<"), copy=False).tobytes()
                fh.write(raw)
                st.sha.update(raw)
                st.files, st.bytes, st.tokens = st.files + 1, st.bytes + len(data), st.tokens + len(ids)
                st.counts += np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
                files.append({"file": p.rel, "bytes": len(data), "tokens": len(ids), "split": split})
    if stats["train"].tokens < 2:
        raise DataError(f"the train split holds {stats['train'].tokens} token(s) ({skipped} file(s) skipped as "
                        "not UTF-8)", field="SRC", value=None, fix="give more text")
    splits = {}
    for split, name in SPLITS.items():
        splits[split] = {**stats[split].record(), "file": name}
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": tok.record(), "dtype": dtype.name,
                "vocab": tok.vocab, "splits": splits, "skipped_not_utf8": skipped, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(folder: Path, field_: str = "data.path") -> dict:
    path = Path(folder) / MANIFEST
    try:
        man = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError("not a token folder (no manifest.json)", field=field_, value=str(folder),
                        fix="write one with: tandem data prepare-text SRC... --out DIR") from None
    except (OSError, ValueError) as e:
        raise DataError(f"unreadable manifest.json ({type(e).__name__}: {e})", field=field_, value=str(folder),
                        fix="prepare the folder again with tandem data prepare-text") from None
    if man.get("format") != FORMAT or man.get("version") != VERSION:
        raise DataError(f"unknown token format {man.get('format')!r} version {man.get('version')!r}",
                        field=field_, value=str(folder), fix="prepare the folder again with this tandem")
    return man


class Codec:
    """Text <-> token ids with the token folder's tokenizer."""

    def __init__(self, folder: str) -> None:
        man = read_manifest(Path(folder), "--data")
        self.kind, self.vocab = man["tokenizer"]["kind"], man["vocab"]
        self.tok = None
        self.special = man["tokenizer"].get("special_tokens", {})
        if self.kind in ("bpe", "hf"):
            from tokenizers import Tokenizer  # optional (tandem[text]), only for a BPE or Hugging Face folder

            self.tok = Tokenizer.from_file(str(Path(folder) / man["tokenizer"]["file"]))

    def encode(self, text: str) -> list[int]:
        """The text's ids as the folder's train split was encoded (no special tokens added)."""
        if self.tok is None:
            return list(text.encode("utf-8"))
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tok.decode(ids)
