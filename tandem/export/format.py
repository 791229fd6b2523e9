"""The export folder's format (version 1): what each file holds, written and read here.

    <out>/model.safetensors                 every weight and buffer once (tied ones: the canonical name)
    <out>/model-0000K-of-0000N.safetensors  instead, above --shard-size, with model.safetensors.index.json
    <out>/tp-R-of-N/model.safetensors       with --tp N: rank R's slices (tp.py), same names
    <out>/config.json                       how to rebuild the model (no weights)
    <out>/manifest.json                     bytes and sha256 of every file and tensor, tied aliases,
                                            dtypes and cast error, provenance

The schema with examples is in docs/export.md. JSON is written with sorted keys, so the same
checkpoint gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from tandem.core.decoder import DECODERS
from tandem.core.errors import CheckpointError, ConfigError

FORMAT, VERSION = "tandem-export", 1
MANIFEST, CONFIG, INDEX = "manifest.json", "config.json", "model.safetensors.index.json"
BUILDER = "tandem.models:build_model"


def tp_folder(rank: int, tp: int) -> str:
    return f"tp-{rank}-of-{tp}"


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def write_json(path: Path, obj) -> dict:
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    with open(path, "wb") as f:
        f.write(data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def build_meta(model_spec: dict) -> nn.Module:
    """The model the spec names, on the meta device: shapes and names, no memory. A factory that cannot
    build there (``transformers``' ``from_pretrained`` refuses a meta-device context: it loads weights)
    is built for real on the CPU instead: its names and shapes are the same, its memory is the model's."""
    from tandem.core.spec import ModelSpec
    from tandem.models import build_model

    spec = ModelSpec(**model_spec)
    try:
        with torch.device("meta"):
            return build_model(spec)
    except ConfigError:
        if ":" not in spec.name:
            raise
    return build_model(spec)  # a factory that fails here too says so, in its own words


def tied_names(model: nn.Module) -> dict[str, str]:
    """alias -> canonical for parameters (and buffers) registered under several names; the canonical
    name is the first one in the module's order (what ``named_parameters()`` keeps)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) in first:
            tied[name] = first[id(t)]
        else:
            first[id(t)] = name
    return tied


def match_model(model: nn.Module, src) -> tuple[list[str], dict[str, str]]:
    """(canonical names in the model's order, tied aliases), after checking the checkpoint holds
    exactly this model's tensors with these shapes."""
    sd = model.state_dict(keep_vars=True)
    tied = {a: c for a, c in tied_names(model).items() if a in sd}
    names = [n for n in sd if n not in tied]
    have = set(src.tensors)
    missing = [n for n in names if n not in have]
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s) of model {src.spec['model']['name']!r}, "
                              f"first {missing[0]!r}", field="checkpoint", value=str(src.path),
                              fix="export with the spec the run was trained with (--spec), or a complete checkpoint")
    extra = sorted(have - set(sd))
    if extra:
        raise CheckpointError(f"the checkpoint holds {len(extra)} tensor(s) model {src.spec['model']['name']!r} "
                              f"does not have, first {extra[0]!r}", field="checkpoint", value=str(src.path),
                              fix="export with the spec the run was trained with (--spec)")
    for n in names:
        want, got = tuple(sd[n].shape), src.tensors[n][1]
        if want != got:
            raise CheckpointError(f"{n!r} is {list(got)} in the checkpoint but {list(want)} in the model",
                                  field="checkpoint", value=str(src.path),
                                  fix="export with the spec the run was trained with (--spec)")
    return names, tied


def example_input(spec: dict, recorded: dict | None = None) -> dict:
    """A batch of one that the model accepts, for `export verify`'s forward and serve's warm-up: the one
    place that decides it. ``recorded``: a train sample's shape and dtype, as the run's checkpoint meta
    keeps it (input_record); without it (checkpoints of earlier versions) what the spec implies."""
    m = spec["model"]
    if m["name"] in DECODERS:
        return {"shape": [1, m["seq"]], "dtype": "int64", "kind": "tokens", "high": m["vocab"]}
    if recorded:
        if "high" in recorded:  # ids of any integer type go in as int64, the type serve's requests carry
            return {**recorded, "dtype": "int64", "kind": "tokens"}
        return {**recorded, "kind": "normal"}
    size = spec.get("data", {}).get("image_size", 8)
    return {"shape": [1, m["in_channels"], size, size], "dtype": "float32", "kind": "normal"}


def make_input(desc: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, desc.get("dtype", "float32"))
    if desc["kind"] == "tokens":
        return torch.randint(0, desc["high"], desc["shape"], generator=g).to(dtype)
    return torch.randn(desc["shape"], generator=g).to(dtype)


def config(src, dtype: str, tied: dict[str, str], shapes: dict[str, list[int]], tp: int) -> dict:
    m = src.spec["model"]
    cfg = {"format": FORMAT, "version": VERSION, "builder": BUILDER, "model": m, "tied": tied, "dtype": dtype,
           "tensors": shapes, "example_input": example_input(src.spec, src.meta.example_input), "tp": tp}
    if ":" in m["name"]:  # a user's factory: what build_model calls it with
        from tandem.core.spec import ModelSpec
        from tandem.models import factory_kwargs

        cfg["factory"] = {"name": m["name"], "kwargs": factory_kwargs(ModelSpec(**m))}
    return cfg


def manifest(files: dict, tensors: dict, tied: dict, dtype: str, record: dict, prov: dict, tp: int,
             tp_ranks: list | None) -> dict:
    return {
        "format": FORMAT, "version": VERSION,
        "files": dict(sorted(files.items())),
        "tensors": dict(sorted(tensors.items())),
        "tied": tied,
        "dtype": {"export": dtype, "source": sorted({t["source_dtype"] for t in tensors.values()}),
                  "max_cast_error": record["max_cast_error"]},
        "tp": None if tp_ranks is None else {
            "degree": tp, "ranks": [{"folder": tp_folder(r, tp), "tensors": dict(sorted(t.items()))}
                                    for r, t in enumerate(tp_ranks)]},
        "provenance": prov,
    }
