"""``data.name = "tokens"``: windows of a token folder (tandem data prepare-text) for next-token training.

Window ``i`` of a split is tokens ``[i*seq, i*seq + seq + 1)``: x = its first seq tokens, y = the seq
tokens after each (every position scored). The windows are a map-style Dataset, a pure function of
the index, so the ResumableDistributedSampler shuffles, shards and resumes them as any other set.
The held-out set is at most ``data.num_samples`` windows spread evenly over the held-out split (0:
all of them), scored at each evaluation: held-out loss (mean nats per token) and bits per byte,
``loss / ln 2 x tokens / bytes`` of that split, next to the order-0 byte entropy of its text.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from tandem.core.decoder import DECODERS
from tandem.core.errors import ConfigError, DataError
from tandem.data.text import read_manifest


class TokenWindows(Dataset):
    """(x, y) int64 tensors of ``seq`` tokens; ``ds[[i, j, ...]]`` gives a stacked batch."""

    def __init__(self, path: Path, dtype: str, seq: int, index: np.ndarray | None = None,
                 tokens_per_byte: float = 1.0, order0: float = 0.0, vocab: int | None = None) -> None:
        self.path, self.dtype, self.seq = Path(path), np.dtype(dtype), seq
        self.vocab = vocab  # the tokenizer's: the range of ids a model of this data reads (export's example input)
        self.tokens_per_byte, self.order0 = tokens_per_byte, order0
        self.n_tokens = self.path.stat().st_size // self.dtype.itemsize
        self.n_windows = max(0, (self.n_tokens - 1) // seq)
        self.index = index  # a subset of window numbers (the held-out set), or None for all
        self._data = None  # opened on first use: each DataLoader worker maps the file itself

    def __len__(self) -> int:
        return len(self.index) if self.index is not None else self.n_windows

    def _window(self, i: int) -> np.ndarray:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        w = int(self.index[i]) if self.index is not None else i % len(self)
        return np.asarray(self._data[w * self.seq: w * self.seq + self.seq + 1], dtype=np.int64)

    def __getitem__(self, i):
        if isinstance(i, (list, tuple, np.ndarray, torch.Tensor)):
            w = torch.from_numpy(np.stack([self._window(int(j)) for j in i]))
            return w[:, :-1], w[:, 1:]
        w = torch.from_numpy(self._window(int(i)))
        return w[:-1], w[1:]

    def __getstate__(self):  # DataLoader workers: no memmap in the pickle
        return {**self.__dict__, "_data": None}


def spread(n_windows: int, k: int) -> np.ndarray | None:
    """k window numbers evenly spread over n (all of them when k is 0 or >= n)."""
    if k <= 0 or k >= n_windows:
        return None
    return np.linspace(0, n_windows - 1, k).round().astype(np.int64)


def load_tokens(folder: str, seq: int, held_out: float, num_samples: int) -> tuple[Dataset, Dataset | None]:
    man = check_folder(folder, seq, held_out > 0)
    folder_ = Path(folder)
    sp = man["splits"]
    train = TokenWindows(folder_ / sp["train"]["file"], man["dtype"], seq, vocab=man["vocab"])
    if held_out <= 0:
        return train, None
    h = sp["held_out"]
    held = TokenWindows(folder_ / h["file"], man["dtype"], seq, tokens_per_byte=h["tokens_per_byte"],
                        order0=h["order0_bits_per_byte"], vocab=man["vocab"])
    held.index = spread(held.n_windows, num_samples)
    return train, held


def check_folder(folder: str, seq: int, need_held: bool, verify: bool = False) -> dict:
    """The manifest of a token folder whose files are whole (sizes; sha256 too with ``verify``) and
    long enough for one window of seq + 1 tokens per split used."""
    if not folder:
        raise DataError("data.name = tokens needs the folder written by tandem data prepare-text",
                        field="data.path", value="(empty)", fix="set data.path = DIR (tandem data prepare-text "
                                                                "SRC... --out DIR)")
    man = read_manifest(Path(folder))
    itemsize = np.dtype(man["dtype"]).itemsize
    for split in ("train", "held_out") if need_held else ("train",):
        s = man["splits"][split]
        path = Path(folder) / s["file"]
        size = path.stat().st_size if path.is_file() else -1
        if size != s["tokens"] * itemsize:
            raise DataError(f"{s['file']} holds {max(size, 0)} bytes, the manifest says {s['tokens']} tokens x "
                            f"{itemsize}", field="data.path", value=folder,
                            fix="prepare the folder again with tandem data prepare-text")
        if verify and hashlib.sha256(path.read_bytes()).hexdigest() != s["sha256"]:
            raise DataError(f"{s['file']} is altered: its sha256 differs from manifest.json", field="data.path",
                            value=folder, fix="prepare the folder again with tandem data prepare-text")
        if s["tokens"] < seq + 1:
            what = "data.held_out" if split == "held_out" else "model.seq"
            raise DataError(f"the {split} split holds {s['tokens']} tokens, one window needs model.seq + 1 = "
                            f"{seq + 1}", field=what, value=seq if what == "model.seq" else 0.0,
                            fix="give more text to prepare-text, a smaller model.seq"
                                + (", or data.held_out = 0 (no evaluation)" if split == "held_out" else ""))
    return man


def check_tokens(spec, model=None) -> None:
    """The parent's check before any worker starts: the folder (sha256 included) against the model
    (``model``: the spec's model as preflight built it, for a factory's vocabulary)."""
    d, m = spec.data, spec.model
    man = check_folder(d.path, m.seq, d.held_out > 0, verify=True)
    if m.name in DECODERS and m.vocab < man["vocab"]:
        raise ConfigError(f"the token folder's vocabulary is {man['vocab']} ({man['tokenizer']['kind']}), the "
                          f"model's {m.vocab}", field="model.vocab", value=m.vocab,
                          fix=f"set model.vocab = {man['vocab']}")
    rows = _embedding_rows(model)
    if rows is not None and rows < man["vocab"]:  # a factory's (a transformers model's) own embedding
        raise ConfigError(f"the token folder's vocabulary is {man['vocab']} ({man['tokenizer']['kind']}), the "
                          f"model's input embedding has {rows} rows", field="model.name", value=m.name,
                          fix=f"build the model with a vocabulary of {man['vocab']} or more, or prepare the "
                              "folder with the model's own tokenizer (prepare-text --tokenizer DIR)")
    if m.name in ("resnet18", "resnet34", "resnet50"):
        raise ConfigError(f"tokens are sequences; {m.name} reads images", field="data.name", value=d.name,
                          fix="use model.name = gpt (or your own factory) with data.name = tokens")


def _embedding_rows(model) -> int | None:
    """Rows of the model's input embedding where it names one (``get_input_embeddings()``, the
    transformers API), else None: a model of one's own is not guessed at."""
    get = getattr(model, "get_input_embeddings", None)
    if not callable(get):
        return None
    try:
        rows = getattr(get(), "num_embeddings", None)
    except Exception:  # a model whose accessor is not implemented (transformers raises NotImplementedError)
        return None
    return rows if isinstance(rows, int) else None


def held_out_summary(held, correct: int, scored: int, nll: float | None) -> tuple[dict, str]:
    """Extra fields of an eval record and its log line: held-out loss and bits per byte for token
    windows (where the held-out set knows its tokens per byte), nothing for other sets."""
    tpb = getattr(held, "tokens_per_byte", None)
    if nll is None or not scored or tpb is None:
        return {}, ""
    loss = nll / scored
    bpb = loss / math.log(2) * tpb
    rec = {"held_out_loss": loss, "bits_per_byte": bpb, "order0_bits_per_byte": held.order0}
    return rec, f", loss {loss:.4f}, {bpb:.3f} bits per byte (order-0 entropy {held.order0:.3f})"
