"""Models by name: the built-in ResNets, or any factory given as 'pkg.module:factory'."""

from __future__ import annotations

import dataclasses
import inspect
import os
import traceback

from torch import nn

from tandem.core.config import did_you_mean
from tandem.core.errors import ConfigError
from tandem.core.factory import import_factory
from tandem.core.hf import is_hf
from tandem.core.spec import ModelSpec
from tandem.models.resnet import ResNet, resnet18, resnet34, resnet50

BUILTIN = {"resnet18": 18, "resnet34": 34, "resnet50": 50}
VALID = " | ".join(BUILTIN) + " | gpt | llama | hf:DIR (a Hugging Face folder) | an import path 'pkg.module:factory'"

__all__ = ["ResNet", "resnet18", "resnet34", "resnet50", "build_model", "model_signature",
           "count_params", "BUILTIN", "factory_kwargs"]


def build_model(spec: ModelSpec) -> nn.Module:
    """The model the spec names, on the CPU, freshly initialised (seed the RNG first); ``hf:DIR``: tandem's
    own model holding the folder's weights (a spec loaded from a file names the model itself instead and
    keeps the folder in ``model.hf``: built fresh here, filled by the materializer)."""
    name = spec.name
    if is_hf(name):  # a Hugging Face folder: tandem's own model, holding its weights (tandem/models/hf.py)
        from tandem.models import hf

        spec = hf.resolve_spec(spec)
        model = build_model(spec)
        return model if any(t.is_meta for t in model.parameters()) else hf.load_into(model, hf.weights_for(spec))
    if name == "gpt":
        from tandem.models.gpt import gpt
        return gpt(layers=spec.layers, hidden=spec.hidden, heads=spec.heads, kv_heads=spec.kv_heads,
                   ffn=spec.ffn, seq=spec.seq, vocab=spec.vocab, tied=spec.tied, gelu=spec.gelu)
    if name == "llama":
        from tandem.models.llama import from_spec
        return from_spec(spec)
    if name in BUILTIN:
        return ResNet(depth=BUILTIN[name], width=spec.width, num_classes=spec.num_classes,
                      in_channels=spec.in_channels, small_input=spec.small_input)
    if ":" not in name:
        raise ConfigError("unknown model", field="model.name", value=name,
                          fix=f"use {VALID} (got {name!r})")
    factory = import_factory(name, field="model.name", valid=VALID)
    kwargs = _call_kwargs(factory, spec)
    try:
        model = factory(**kwargs)
    except Exception as e:  # the keywords bind (checked above): whatever it raised is the body's own
        module_name, _, attr = name.partition(":")
        call = f"{attr}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        raise ConfigError(f"factory {name!r} raised {type(e).__name__}: {_one_line(e)}{_where(e, factory)}",
                          field="model.name", value=name, fix=f"fix the factory; try it by hand: python -c "
                                                              f"'import {module_name}; {module_name}.{call}'") from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"factory {name!r} returned {type(model).__name__}, not an nn.Module",
                          field="model.name", value=name, fix="return a torch.nn.Module from the factory")
    return model


# Fields of [model] that are tandem's own, never a factory's keyword even when it names one.
NOT_FOR_FACTORY = ("name", "loss", "extra", "hf", "gelu")


def factory_kwargs(spec: ModelSpec) -> dict:
    """The keywords build_model calls the spec's factory with (what an export records)."""
    return _call_kwargs(import_factory(spec.name, field="model.name", valid=VALID), spec)


def _call_kwargs(factory, spec: ModelSpec) -> dict:
    """The [model] fields the factory's signature names, and every key of model.extra; a ConfigError
    (with 'did you mean') for an extra key it does not take or a parameter nothing gives."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in NOT_FOR_FACTORY}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (a C callable): the classifier's two, and extra
        return {"num_classes": spec.num_classes, "in_channels": spec.in_channels, **spec.extra}
    named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not named and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ConfigError(f"factory {spec.name!r} takes no keywords, so the spec cannot size it",
                          field="model.name", value=spec.name,
                          fix="give it the parameters it needs from [model], e.g. num_classes=, in_channels=, "
                              "and keys of its own (width=, depth=)")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        base = {k: fields[k] for k in ("num_classes", "in_channels")}
        kwargs = {**base, **{p.name: fields[p.name] for p in named if p.name in fields}, **spec.extra}
    else:
        accepts = [p.name for p in named]
        for key in spec.extra:
            if key not in accepts:
                raise ConfigError(f"factory {spec.name!r} takes no keyword {key!r} (it takes "
                                  f"{', '.join(accepts) or 'none'})", field=f"model.{key}", value=spec.extra[key],
                                  fix=did_you_mean(f"model.{key}", [f"model.{a}" for a in accepts]))
        kwargs = {**{p.name: fields[p.name] for p in named if p.name in fields}, **spec.extra}
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in kwargs
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        raise ConfigError(f"factory {spec.name!r} needs {missing[0]}= and the [model] section does not give it",
                          field=f"model.{missing[0]}", value=spec.name,
                          fix=f"add {missing[0]} = ... under [model] (or --model.{missing[0]} VALUE), or give "
                              f"the parameter a default")
    return kwargs


def _where(e: BaseException, factory) -> str:
    """' (at file:line)': the deepest frame of the traceback in the factory's own file, else the deepest."""
    frames = traceback.extract_tb(e.__traceback__)[1:]  # [0] is build_model's call
    if not frames:
        return ""
    try:
        own = inspect.getsourcefile(factory)
    except TypeError:
        own = None
    mine = [f for f in frames if own and f.filename == own] or frames
    f = mine[-1]
    return f" (at {_short_path(f.filename)}:{f.lineno})"


def _short_path(path: str) -> str:
    try:
        return os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    except ValueError:
        return path


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


def model_signature(model: nn.Module) -> dict[str, list[int]]:
    """Name -> shape of every parameter and buffer: two models load each other's
    checkpoints only if their signatures are equal."""
    sig = {name: list(p.shape) for name, p in model.named_parameters()}
    sig.update({name: list(b.shape) for name, b in model.named_buffers()})
    return sig


def count_params(model: nn.Module) -> int:
    """Number of parameters (shared ones counted once), buffers excluded."""
    return sum(p.numel() for p in model.parameters())
