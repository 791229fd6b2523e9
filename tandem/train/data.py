"""Data sets as in-memory TensorDatasets of (float32 image N,C,H,W ; int64 label).

Everything here is small enough to sit in memory on every rank, and every split
is a pure function of the seed, so all ranks build the same sets without talking
to each other. Three sources:

- digits: scikit-learn's 1797 real 8x8 handwritten digits (bundled, no download);
- synthetic: Gaussian images labelled by a random linear "teacher" (learnable);
- npz: your own arrays x (N,C,H,W) and y (N,), used as stored.

Two more, in tandem/data/: ``tokens`` (windows of a token folder, memory-mapped) and
``pkg.module:factory`` (your own map-style Datasets).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from tandem.core.errors import DataError
from tandem.core.spec import DataSpec
from tandem.core.steps import DIGITS_SAMPLES, held_out_count
from tandem.train.datacheck import check_digits, check_synthetic, load_npz



def load_datasets(spec: DataSpec, seed: int, num_classes: int,
                  in_channels: int, seq: int = 16) -> tuple[Dataset, Dataset | None]:
    """(train, held_out) for the spec; held_out is None when spec.held_out == 0.
    ``seq``: sequence length of the token tasks (reverse, sort: see tandem.train.tasks)."""
    if spec.name in ("reverse", "sort"):
        from tandem.train.tasks import load_task
        return load_task(spec.name, spec.num_samples, seq, spec.held_out, seed)
    if spec.name == "digits":
        return _digits(spec, seed, num_classes, in_channels)
    if spec.name == "synthetic":
        return _synthetic(spec, seed, num_classes, in_channels)
    if spec.name == "npz":
        return _npz(spec, seed, num_classes, in_channels)
    if spec.name == "tokens":  # a token folder of tandem data prepare-text: next-token windows
        from tandem.data.tokens import load_tokens
        return load_tokens(spec.path, seq, spec.held_out, spec.num_samples)
    if ":" in spec.name:  # your own: a 'pkg.module:factory' returning (train, held_out)
        from tandem.data.user import load_user
        return load_user(spec, seed, num_classes, in_channels, seq)
    raise DataError("unknown data set", field="data.name", value=spec.name,
                    fix="use digits | synthetic | npz | reverse | sort | tokens | 'pkg.module:factory'")


def _seeded_split(x: torch.Tensor, y: torch.Tensor, frac: float, seed: int):
    """Random split by a seeded permutation: the same seed gives the same split."""
    k = held_out_count(len(y), frac)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, held = perm[k:], perm[:k]
    return x[train], y[train], (x[held], y[held]) if k else None


def _pack(x: torch.Tensor, y: torch.Tensor, held) -> tuple[Dataset, Dataset | None]:
    train = TensorDataset(x.float().contiguous(), y.long().contiguous())
    if held is None:
        return train, None
    return train, TensorDataset(held[0].float().contiguous(), held[1].long().contiguous())


def cache_dir() -> Path:
    """Where derived data is kept between runs: ``TANDEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/tandem``
    (``~/.cache/tandem``)."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"


def _digits_split(k: int, seed: int) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_held, y_held) of digits, stratified, from a cache when one exists.

    Importing scikit-learn costs every worker more CPU at every (re)start than the rest of a
    small job's data path (docs/bench.md); the split is a pure function of (k, seed, the
    scikit-learn release), so one run computes it and the next ones read 0.5 MB of arrays."""
    from importlib.metadata import version

    # v1: images / 16 as float32, labels int64, split by train_test_split(stratify=y)
    path = cache_dir() / f"digits-v1-sklearn{version('scikit-learn')}-held{k}-seed{seed}.npz"
    try:
        with np.load(path) as z:
            return tuple(z[n] for n in ("x_tr", "y_tr", "x_ho", "y_ho"))
    except Exception:  # absent, or damaged (a zip error, a missing array): compute it again
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.images.astype(np.float32) / 16.0  # pixel values are 0..16
    y = d.target.astype(np.int64)
    if k:
        # Stratified so that every class is in both halves in the same proportion.
        x_tr, x_ho, y_tr, y_ho = train_test_split(x, y, test_size=k, random_state=seed, stratify=y)
    else:
        x_tr, y_tr, x_ho, y_ho = x, y, x[:0], y[:0]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{socket.gethostname()}-{os.getpid()}.tmp.npz")  # a shared home too
        np.savez(tmp, x_tr=x_tr, y_tr=y_tr, x_ho=x_ho, y_ho=y_ho)
        os.replace(tmp, path)  # whole or absent: ranks starting together may race to write it
    except OSError:
        pass  # a read-only home: no cache, same data
    return x_tr, y_tr, x_ho, y_ho


def _digits(spec: DataSpec, seed: int, num_classes: int, in_channels: int):
    check_digits(num_classes)
    k = held_out_count(DIGITS_SAMPLES, spec.held_out)
    x_tr, y_tr, x_ho, y_ho = _digits_split(k, seed)

    # Statistics of the train split only: the held-out set must not leak into them.
    mean, std = float(x_tr.mean()), float(x_tr.std())

    def prep(a: np.ndarray) -> torch.Tensor:
        t = (torch.from_numpy(a).unsqueeze(1) - mean) / std  # (N,1,8,8)
        if spec.image_size != 8:
            t = F.interpolate(t, size=(spec.image_size, spec.image_size), mode="bilinear",
                              align_corners=False)
        if in_channels > 1:
            t = t.repeat(1, in_channels, 1, 1)  # grey to "RGB" for 3-channel models
        return t

    held = (prep(x_ho), torch.from_numpy(y_ho)) if k else None
    return _pack(prep(x_tr), torch.from_numpy(y_tr), held)


def _synthetic(spec: DataSpec, seed: int, num_classes: int, in_channels: int):
    check_synthetic(spec)
    g = torch.Generator().manual_seed(seed)
    s = spec.image_size
    x = torch.randn(spec.num_samples, in_channels, s, s, generator=g)
    # The teacher reads a coarse (at most 4x4) average of each channel: a smooth,
    # low-dimensional rule that a conv net (or a linear probe) can learn quickly.
    p = min(4, s)
    feats = F.adaptive_avg_pool2d(x, p).flatten(1)
    teacher = torch.randn(feats.shape[1], num_classes, generator=g)
    y = (feats @ teacher).argmax(dim=1)
    # Split with a different stream than the data so the split is not tied to the draw.
    return _pack(*_seeded_split(x, y, spec.held_out, seed + 1))


def _npz(spec: DataSpec, seed: int, num_classes: int, in_channels: int):
    x, y = load_npz(spec, num_classes, in_channels)  # the checks the parent ran before launch, again
    x_t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    y_t = torch.from_numpy(y.astype(np.int64))
    return _pack(*_seeded_split(x_t, y_t, spec.held_out, seed))
