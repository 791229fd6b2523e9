"""``data.name = "pkg.module:factory"``: your own data sets, trained on like the built-in ones.

The factory is imported as model factories are (tandem/core/factory.py: the working directory,
then PYTHONPATH) and called with the keywords it accepts among

    seed, held_out, path, num_samples, image_size, seq, num_classes, in_channels

(all of them if it takes ``**kwargs``). It returns ``(train, held_out)``: two map-style
``torch.utils.data.Dataset``s (``len`` and ``ds[i]``), ``held_out`` may be None (no evaluation).
Item ``i`` is ``(x, y)``, two tensors: ``y`` an integer class label (shape ``()``) or integer token
targets (shape ``(T,)``, -100 for positions not scored). Every rank calls the factory and must get
the same sets (a pure function of the seed): tandem's sampler shards them by index, so the exact
resume position and the held-out split work as for the built-in sets.

Iterable datasets are refused: a stream has no index, so a sampler cannot shard it, nor a
checkpoint say where in it a run stopped. Wrap the stream into a map-style set (read it into
memory, or index the records of a file) instead.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from tandem.core.errors import ConfigError, DataError, TandemError
from tandem.core.factory import import_factory

VALID = "digits | synthetic | npz | reverse | sort | tokens | an import path 'pkg.module:factory'"
FIX_RETURN = "return (train, held_out): two map-style torch Datasets whose items are (x, y) tensors"


class Indexed(Dataset):
    """A user's Dataset as the trainer reads it: y as int64, and ``ds[[i, j]]`` as a stacked batch
    (what evaluation asks of a TensorDataset)."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):
        if isinstance(i, (list, tuple, torch.Tensor)):
            return default_collate([self[int(j)] for j in i])
        x, y = self.ds[i]
        return x, torch.as_tensor(y).long()


def _kwargs(factory, offered: dict) -> dict:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return offered
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return offered
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in offered.items() if k in names}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


def load_user(spec, seed: int, num_classes: int, in_channels: int, seq: int) -> tuple[Dataset, Dataset | None]:
    """(train, held_out) from the factory, each checked and wrapped (Indexed)."""
    name = spec.name
    factory = import_factory(name, field="data.name", valid=VALID)
    offered = {"seed": seed, "held_out": spec.held_out, "path": spec.path, "num_samples": spec.num_samples,
               "image_size": spec.image_size, "seq": seq, "num_classes": num_classes, "in_channels": in_channels}
    try:
        got = factory(**_kwargs(factory, offered))
    except TandemError:  # already one line that says what to do (a missing extra: core.extras.require)
        raise
    except Exception as e:
        raise DataError(f"factory {name!r} raised {type(e).__name__}: {_one_line(e)}", field="data.name",
                        value=name, fix="fix the factory; it is called with the keywords it accepts among "
                                        + ", ".join(offered)) from e
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise DataError(f"factory {name!r} returned {type(got).__name__}, not a pair (train, held_out)",
                        field="data.name", value=name, fix=FIX_RETURN)
    train, held = got
    first = check_set(train, name, "train")
    if held is not None:
        check_set(held, name, "held-out", like=first)
    return Indexed(train), (Indexed(held) if held is not None else None)


def check_set(ds, name: str, which: str, like: tuple | None = None) -> tuple:
    """(x, y) of item 0 of a set that passes; DataError naming what is wrong otherwise."""
    if isinstance(ds, IterableDataset):
        raise DataError(f"the {which} set is an IterableDataset: a stream cannot be sharded by index nor resumed "
                        "at an exact position", field="data.name", value=name,
                        fix="return a map-style Dataset (__len__ and __getitem__), e.g. the stream's records "
                            "read into memory or indexed in their file")
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise DataError(f"the {which} set is a {type(ds).__name__}, without __len__ and __getitem__",
                        field="data.name", value=name, fix=FIX_RETURN)
    if len(ds) < 1:
        raise DataError(f"the {which} set is empty", field="data.name", value=name, fix="return at least one sample")
    try:
        item = ds[0]
    except Exception as e:
        raise DataError(f"reading item 0 of the {which} set raised {type(e).__name__}: {_one_line(e)}",
                        field="data.name", value=name, fix="make ds[i] work for 0 <= i < len(ds)") from e
    if not (isinstance(item, (tuple, list)) and len(item) == 2
            and all(isinstance(t, torch.Tensor) for t in item)):
        what = type(item).__name__ if not isinstance(item, (tuple, list)) else \
            f"({', '.join(type(t).__name__ for t in item)})"
        raise DataError(f"item 0 of the {which} set is {what}, not (x, y) tensors", field="data.name",
                        value=name, fix="return (x, y) from __getitem__: x the input tensor, y an integer "
                                        "label tensor (or (T,) token targets)")
    x, y = item
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool or y.dim() > 1:
        raise DataError(f"y of item 0 of the {which} set is {y.dtype} of shape {tuple(y.shape)}, expected an "
                        "integer class label () or integer token targets (T,)", field="data.name", value=name,
                        fix="return y as torch.tensor(label) (int64), or (T,) token ids with -100 where unscored")
    if like is not None and (tuple(x.shape), tuple(y.shape)) != (tuple(like[0].shape), tuple(like[1].shape)):
        raise DataError(f"the held-out items are x {tuple(x.shape)}, y {tuple(y.shape)}; the train items x "
                        f"{tuple(like[0].shape)}, y {tuple(like[1].shape)}", field="data.name", value=name,
                        fix="give both sets samples of one shape")
    return x, y


def check_against_model(model, x: torch.Tensor, y: torch.Tensor, name: str) -> None:
    """One sample through the model built on the meta device (no memory, no compute): a shape that
    the model cannot read, or an output that does not fit y, is an error before any worker starts."""
    if model is None:
        return
    # meta, unless the factory could only be built for real (preflight.build_on_meta); eval mode, since
    # a batch of one is no batch for BatchNorm's training statistics
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x.unsqueeze(0).to(device))
    except NotImplementedError:
        return  # an op with no meta kernel cannot be checked here; the workers run it for real
    except Exception as e:
        raise DataError(f"the model cannot read the data set's samples: model(x[None]) with x "
                        f"{tuple(x.shape)} {x.dtype} raised {type(e).__name__}: {_one_line(e)}",
                        field="data.name", value=name, fix="make the data set's x the shape and dtype the model "
                                                          "takes (or the model fit the data)") from None
    finally:
        model.train(was)
    out = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", out)
    if not isinstance(out, torch.Tensor):
        return
    want = (1, out.shape[-1]) if y.dim() == 0 else (1, *y.shape, out.shape[-1])
    if tuple(out.shape) != want:
        raise DataError(f"the model's output for one sample is {tuple(out.shape)}; y {tuple(y.shape)} needs "
                        f"(1, classes)" if y.dim() == 0 else f"the model's output for one sample is "
                        f"{tuple(out.shape)}; token targets y {tuple(y.shape)} need (1, {y.shape[0]}, vocab)",
                        field="data.name", value=name, fix="return logits the shape of the targets (class "
                                                          "scores per sample, or per position)")
    if y.dim() == 0 and not 0 <= int(y) < out.shape[-1]:
        raise DataError(f"label {int(y)} of item 0 is outside the model's {out.shape[-1]} classes",
                        field="data.name", value=name, fix=f"set model.num_classes above {int(y)}")


def check_user_data(spec, model=None) -> None:
    """The parent's check: build the sets once (as every worker will) and read one sample through the model."""
    if ":" not in spec.data.name:
        raise ConfigError("unknown data set", field="data.name", value=spec.data.name, fix=f"use {VALID}")
    m = spec.model
    train, _ = load_user(spec.data, spec.schedule.seed, m.num_classes, m.in_channels, m.seq)
    x, y = train[0]
    check_against_model(model, x, y, spec.data.name)
