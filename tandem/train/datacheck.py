"""The data source checked against the model with numpy only, before any worker starts.

``check_source(spec)`` is what the parent runs (tandem.train.preflight); the workers'
loaders (tandem.train.data) run its data checks again. For an .npz (arrays x (N,C,H,W), y (N,))
it reads x's header (shape, dtype: no pixel is loaded) and the labels; ``load_npz``
returns the arrays once they pass.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
from numpy.lib import format as npy

from tandem.core.decoder import DECODERS
from tandem.core.errors import ConfigError, DataError
from tandem.core.extras import require
from tandem.core.spec import DataSpec, JobSpec

DIGITS_CLASSES = 10
TOKEN_TASKS = ("reverse", "sort")
MIN_VOCAB = 11  # digits 0..9 and the separator (tandem.train.tasks)
RESNETS = ("resnet18", "resnet34", "resnet50")  # tandem.models.BUILTIN, named here without importing torch

FIX_WRITE = "save with np.savez(path, x=images_NCHW, y=labels_N)"


def check_source(spec: JobSpec, model=None) -> None:
    """Raise DataError/ConfigError when the data set cannot feed the model the spec names
    (``model``: the spec's model on the meta device, which your own data's first sample goes through)."""
    d, m = spec.data, spec.model
    if d.name == "tokens":
        from tandem.data.tokens import check_tokens
        return check_tokens(spec, model)
    if ":" in d.name:
        from tandem.data.user import check_user_data
        return check_user_data(spec, model)
    tokens = d.name in TOKEN_TASKS
    if tokens and m.name in RESNETS:
        raise ConfigError(f"{d.name} is a token task; {m.name} reads images", field="data.name", value=d.name,
                          fix="use model.name=gpt for reverse/sort, or an image set (digits | synthetic | npz)")
    if not tokens and m.name in DECODERS:
        raise ConfigError(f"{m.name} reads token sequences; {d.name} holds images", field="data.name", value=d.name,
                          fix=f"use data.name=reverse or sort with {m.name}, or an image model (resnet18 ...)")
    if tokens:
        if m.seq < 2:
            raise DataError(f"seq {m.seq} leaves no room for digits (need seq >= 2)", field="model.seq",
                            value=m.seq, fix="set model.seq to 2 or more (n digits take 2n positions)")
        if m.name in DECODERS and m.vocab < MIN_VOCAB:
            raise ConfigError(f"the {d.name} task has {MIN_VOCAB} tokens (digits and a separator), the model's "
                              f"vocabulary {m.vocab}", field="model.vocab", value=m.vocab,
                              fix=f"set model.vocab to {MIN_VOCAB} or more")
    if d.name == "digits":
        check_digits(m.num_classes)
    elif d.name == "synthetic":
        check_synthetic(d)
    elif d.name == "npz":
        check_npz(d, m.num_classes, m.in_channels)


def check_digits(num_classes: int) -> None:
    """Before the parent starts workers, and in each worker before it loads the set."""
    require("examples", "the digits data set (data.name = \"digits\")")
    if num_classes < DIGITS_CLASSES:
        raise DataError(f"digits has {DIGITS_CLASSES} classes, the model only {num_classes}",
                        field="model.num_classes", value=num_classes, fix="set model.num_classes = 10")


def check_synthetic(spec: DataSpec) -> None:
    if spec.num_samples < 2:
        raise DataError("synthetic needs at least 2 samples", field="data.num_samples",
                        value=spec.num_samples, fix="set data.num_samples to 2 or more")


def _value(spec: DataSpec) -> str:
    return spec.path or "(empty)"


def _header(zf: zipfile.ZipFile, name: str) -> tuple[tuple[int, ...], np.dtype]:
    with zf.open(f"{name}.npy") as f:
        major, _ = npy.read_magic(f)
        shape, _, dtype = (npy.read_array_header_1_0 if major == 1 else npy.read_array_header_2_0)(f)
    return tuple(shape), dtype


def check_npz(spec: DataSpec, num_classes: int, in_channels: int) -> tuple[tuple[int, ...], np.ndarray]:
    """(x's shape, y) of a valid file; raises DataError naming what is wrong and the fix."""
    path, value = Path(spec.path), _value(spec)
    if not spec.path or not path.is_file():
        raise DataError("data file not found", field="data.path", value=value,
                        fix="give an existing .npz with arrays x (N,C,H,W) and y (N,)")
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
            missing = [k for k in ("x", "y") if k not in names]
            if missing:
                raise DataError(f"array(s) {', '.join(missing)} missing (found: {', '.join(names) or 'none'})",
                                field="data.path", value=value, fix=FIX_WRITE)
            shape, dtype = _header(zf, "x")
        with np.load(path, allow_pickle=False) as z:
            y = z["y"]
    except DataError:
        raise
    except Exception as e:  # not a zip, truncated, pickled objects...
        raise DataError(f"cannot read ({type(e).__name__}: {e})", field="data.path", value=value,
                        fix="write the file with np.savez(path, x=..., y=...)") from e
    _check_arrays(shape, dtype, y, num_classes, in_channels, value)
    return shape, y


def _check_arrays(shape: tuple[int, ...], dtype: np.dtype, y: np.ndarray, num_classes: int, in_channels: int,
                  value: str) -> None:
    if len(shape) != 4 or y.ndim != 1:
        raise DataError(f"x has shape {shape} and y {y.shape}, expected (N,C,H,W) and (N,)",
                        field="data.path", value=value, fix="reshape x to (N,C,H,W) and y to (N,)")
    if not (np.issubdtype(dtype, np.number) or dtype == np.bool_) or np.issubdtype(dtype, np.complexfloating):
        raise DataError(f"images have dtype {dtype}, expected real numbers", field="data.path", value=value,
                        fix="save x as float32 (or any integer/float type)")
    if shape[0] != len(y):
        raise DataError(f"x has {shape[0]} samples but y has {len(y)}", field="data.path", value=value,
                        fix="save one label per image")
    if len(y) < 2:
        raise DataError(f"only {len(y)} sample(s)", field="data.path", value=value, fix="save at least 2 samples")
    if shape[1] != in_channels:
        raise DataError(f"images have {shape[1]} channels, the model expects {in_channels}",
                        field="data.path", value=value, fix=f"set model.in_channels = {shape[1]}")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"labels have dtype {y.dtype}, expected integers", field="data.path",
                        value=value, fix="save y as integer class indices")
    if y.min() < 0 or y.max() >= num_classes:
        raise DataError(f"labels span {y.min()}..{y.max()}, the model has {num_classes} classes",
                        field="data.path", value=value,
                        fix=f"set model.num_classes = {int(y.max()) + 1} or relabel to 0..{num_classes - 1}")


def load_npz(spec: DataSpec, num_classes: int, in_channels: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a file that passes ``check_npz``."""
    _, y = check_npz(spec, num_classes, in_channels)
    try:
        with np.load(spec.path, allow_pickle=False) as z:
            return z["x"], y
    except Exception as e:
        raise DataError(f"cannot read ({type(e).__name__}: {e})", field="data.path", value=_value(spec),
                        fix="write the file with np.savez(path, x=..., y=...)") from e
